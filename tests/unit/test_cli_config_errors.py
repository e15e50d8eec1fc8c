"""Bad flags, environment variables and config files end in one line naming the flag,
variable or file, the key and the value, before anything expensive starts (a model load,
torchrun, a bind), never in a traceback, a hang or gigabytes of memory. Each test but the
one of "shipped configs" fails without its fix."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from embedding_store import cli
from embedding_store.errors import UnavailableError
from embedding_store.grpc_common import bind_tier_port
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
EMBEDDING_CONFIG = ROOT / "examples" / "configs" / "embedding_config.yml"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port held by a listening socket of this test (so no server can bind it)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _cannot_listen(address: str) -> str:
    return (
        f"cannot listen on {address}: the port is in use, or the host is not an address of "
        "this machine (port 0 picks a free port)"
    )


# --------------------------------------------------------------------------- binding tier ports
def test_a_tier_port_that_cannot_be_bound_is_an_unavailable_error(taken_port) -> None:
    server = grpc.server(thread_pool=None, options=[("grpc.so_reuseport", 0)])
    try:
        with pytest.raises(UnavailableError) as caught:
            bind_tier_port(server, f"127.0.0.1:{taken_port}")
        assert caught.value.message == _cannot_listen(f"127.0.0.1:{taken_port}")
    finally:
        server.stop(0)


def test_embedding_worker_on_a_taken_port_ends_in_one_line(taken_port, capsys) -> None:
    """It used to end in a RuntimeError traceback (the parameter server said it in a line)."""
    argv = ["embedding-worker", "--ps", "127.0.0.1:1", "--embedding-config",
            str(EMBEDDING_CONFIG), "--port", str(taken_port), "--startup-timeout", "0",
            "--grace-seconds", "0"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"recserve embedding-worker: error: {_cannot_listen(f'127.0.0.1:{taken_port}')}"
    )
    assert "Traceback" not in err


def test_embedding_worker_binds_an_ipv6_host_in_brackets(monkeypatch) -> None:
    """``--host ::1`` was bound as ``::1:0``, which gRPC cannot parse (the parameter server
    wrote ``[::1]:0``)."""
    from embedding_store import worker_service
    from embedding_store.config import load_embedding_config

    bound: list[str] = []

    def refuse(_server: grpc.Server, address: str) -> int:
        bound.append(address)
        raise UnavailableError("stop here")

    monkeypatch.setattr(worker_service, "bind_tier_port", refuse)
    with pytest.raises(UnavailableError, match="stop here"):
        worker_service.serve_embedding_worker(
            load_embedding_config(EMBEDDING_CONFIG), ["127.0.0.1:1"], host="::1", port=7
        )
    assert bound == ["[::1]:7"]


# --------------------------------------------------------------------------- config messages
def _alias_bomb(levels: int) -> str:
    """A YAML list of ``9**levels`` strings in ``levels + 1`` short lines: each level an
    anchored list of nine aliases of the level below (the lists are shared once loaded)."""
    anchors = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    anchors += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "[" + ", ".join(anchors) + "]"


def test_a_yaml_alias_bomb_is_refused_without_writing_out_its_repr(tmp_path) -> None:
    """The message showed ``repr`` of the bad value cut to 80 characters, but made all of it
    first: for an alias bomb (small on disk and in memory) that is gigabytes and hangs the
    loader. Now only what is shown is made."""
    import tracemalloc

    from embedding_store.config import EmbeddingConfig, from_mapping, read_yaml_mapping
    from embedding_store.errors import ConfigError

    path = tmp_path / "embedding_config.yml"
    path.write_text(
        f"slots_config: {{s: {{dim: 8}}}}\nfeature_index_prefix_bit: {_alias_bomb(6)}\n"
    )
    data = read_yaml_mapping(path)  # 9**6 = 531441 strings, their full repr ~2.6 MB
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            from_mapping(EmbeddingConfig, data, source=str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.message == (
        f"{path}: feature_index_prefix_bit: expected an integer, got "
        "[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], [['x', 'x', 'x', 'x', 'x', 'x... (list)"
    )
    assert peak < 200_000  # bytes: a message, not the repr of half a million strings


@pytest.mark.parametrize(
    "value",
    [[1, (2,), (), {"a": [1, "x"]}], (1, 2), {}, [], {1: None, "b": 2.5}, "x" * 100,
     [[1] * 40] * 3, ("t",)],
)  # fmt: skip
def test_values_in_messages_read_as_their_repr_cut_to_80_characters(value) -> None:
    from embedding_store.config.strict import describe_value

    text = repr(value)
    shown = text if len(text) <= 80 else text[:77] + "..."
    assert describe_value(value).rsplit(" (", 1)[0] == shown


# --------------------------------------------------------------------------- training processes
@pytest.mark.parametrize("command", ["train", "data-loader"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("http://10.0.0.5:7000",
         "'http://10.0.0.5:7000' is a URL: give HOST:PORT, without http:// (e.g. 10.0.0.5:7000)"),
        ("10.0.0.5", "'10.0.0.5' is not HOST:PORT"),
        ("a:1,:7000", "':7000' is not HOST:PORT"),
        ("a:70000", "'a:70000' is not HOST:PORT"),
        (" , ", "give at least one HOST:PORT"),
    ],
)  # fmt: skip
def test_nn_worker_addresses_are_host_port(capsys, command, value, message) -> None:
    """They went to the script unchecked: each NN worker then failed to listen (int() of a
    missing port, in a traceback) and each loader to dial, once torchrun had started them."""
    argv = [command, "--entry", "t.py", "--nn-worker-addresses", value]
    if command == "data-loader":
        argv += ["--replica-index", "0", "--replica-size", "1"]
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"recserve {command}: error: argument --nn-worker-addresses: {message}"
    )
    argv[4] = "10.0.0.5:7000, 10.0.0.6:7000"
    assert cli.build_parser().parse_args(argv).nn_worker_addresses == argv[4]


@pytest.mark.parametrize("name", ["RECSERVE_REPLICA_INDEX", "RECSERVE_REPLICA_SIZE"])
def test_a_data_loader_replica_variable_that_is_no_integer_is_named(monkeypatch, name) -> None:
    """It was a bare ValueError ("invalid literal for int() with base 10: 'one'")."""
    from embedding_store.errors import InvalidArgumentError
    from training.data import DataCtx

    monkeypatch.setenv(name, "one")
    with pytest.raises(InvalidArgumentError) as caught:
        DataCtx(["127.0.0.1:1"])
    assert caught.value.message == f"{name} must be an integer, got 'one'"


@pytest.mark.parametrize("entry", ["10.0.0.5", "10.0.0.5:", "10.0.0.5:x", "10.0.0.5:0"])
def test_an_nn_worker_entry_without_a_port_is_named(monkeypatch, entry) -> None:
    """Its port was read with int(): a bare ValueError, or port 0 (any free port, which no
    loader dials)."""
    from embedding_store.errors import InvalidArgumentError
    from training.data import StreamingDataset

    for variable in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("RECSERVE_NN_WORKER_ADDRESSES", entry)
    with pytest.raises(InvalidArgumentError) as caught:
        StreamingDataset()
    assert caught.value.message == (
        f"RECSERVE_NN_WORKER_ADDRESSES: {entry!r} is not HOST:PORT with a port in 1..65535"
    )
    monkeypatch.setenv("RECSERVE_NN_WORKER_ADDRESSES", "127.0.0.1:7000")
    dataset = StreamingDataset()
    assert (dataset.host, dataset.port) == ("127.0.0.1", 7000)


# --------------------------------------------------------------------------- listening hosts
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--checkpoint", "runs/x"],
        ["embedding-worker"],
        ["embedding-parameter-server", "--replica-index", "0", "--replica-size", "1",
         "--port", "0"],
    ],
)  # fmt: skip
@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_listening_host_is_refused(capsys, argv, host) -> None:
    """``--host "$HOST"`` with HOST unset: serve bound its HTTP port on every interface ("")
    and then failed on gRPC as if its port were taken; the worker ended in a traceback."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*argv, "--host", host])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"recserve {argv[0]}: error: argument --host: expected a non-empty value"
    )
    assert cli.build_parser().parse_args([*argv, "--host", "0.0.0.0"]).host == "0.0.0.0"


# --------------------------------------------------------------------------- shard counts
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["checkpoint", "reshard", "ckpt", "--out", "out", "--shards"], "--shards"),
        (["embedding-parameter-server", "--replica-index", "0", "--port", "0",
          "--replica-size"], "--replica-size"),
    ],
)  # fmt: skip
def test_shard_counts_are_at_most_what_a_manifest_holds(capsys, argv, flag) -> None:
    """A manifest holds at most 65536 shards (its readers refuse more): ``checkpoint reshard
    --shards 100000000`` read the source once per shard for hours and then wrote a manifest
    no reader takes, and a tier of more shards dumped such checkpoints."""
    from embedding_store.checkpoint_manifest import MAX_SHARDS

    assert MAX_SHARDS == 65536
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*argv, "65537"])
    assert exited.value.code == 2
    command = " ".join(argv[:2]) if argv[0] == "checkpoint" else argv[0]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"recserve {command}: error: argument {flag}: expected an integer in 1..65536, got 65537"
    )
    parsed = cli.build_parser().parse_args([*argv, "65536"])
    assert getattr(parsed, flag.lstrip("-").replace("-", "_")) == 65536


def test_reshard_refuses_more_shards_than_a_manifest_holds(tmp_path) -> None:
    from clients import checkpoint_write
    from embedding_store.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as refused:
        checkpoint_write.reshard(tmp_path / "missing", 65537, tmp_path / "out")
    assert refused.value.message == "--shards must be an integer in 1..65536, got 65537"
    assert list(tmp_path.iterdir()) == []  # refused before anything is read or written


# --------------------------------------------------------------------------- YAML 1.1 words
_QUOTE_BOOLEAN = (
    ": YAML reads unquoted yes/no/on/off/true/false as booleans; quote it for a string (e.g. 'no')"
)


@pytest.mark.parametrize(
    ("text", "expected", "quoted"),
    [
        # A feature named "no": the message showed "False", which nobody typed.
        ("slots_config: {no: {dim: 8}}\n",
         "slots_config: keys must be strings, got key False (boolean)" + _QUOTE_BOOLEAN,
         "slots_config: {'no': {dim: 8}}\n"),
        ("slots_config: {'On': {dim: 8}}\nfeature_groups: {g: [On]}\n",
         "feature_groups.g[0]: expected a string, got True (boolean)" + _QUOTE_BOOLEAN,
         "slots_config: {'On': {dim: 8}}\nfeature_groups: {g: ['On']}\n"),
        ("slots_config: {2024: {dim: 8}}\n",
         "slots_config: keys must be strings, got key 2024 (integer): quote it for a string",
         "slots_config: {'2024': {dim: 8}}\n"),
    ],
)  # fmt: skip
def test_a_name_yaml_read_as_a_boolean_or_number_says_to_quote_it(
    tmp_path, text, expected, quoted
) -> None:
    from embedding_store.config import load_embedding_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "embedding_config.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_embedding_config(path)
    assert caught.value.message == f"{path}: {expected}"
    path.write_text(quoted)  # what the hint says to write loads
    assert len(load_embedding_config(path).slot_names) == 1


def test_a_label_value_yaml_read_as_a_boolean_says_to_quote_it(tmp_path) -> None:
    """``positive`` takes a string or a list of them (a union): the hint is given there too."""
    from clients.eval_mapping import load_mapping
    from embedding_store.errors import ConfigError

    path = tmp_path / "feature_mapping.yml"
    path.write_text("preprocessor: m:f\nlabel: {column: y, positive: yes}\n")
    with pytest.raises(ConfigError) as caught:
        load_mapping(path)
    assert caught.value.message == (
        f"{path}: label.positive: expected str or list or null, got True (boolean)" + _QUOTE_BOOLEAN
    )


# --------------------------------------------------------------------------- URLs as addresses
def test_an_embedding_worker_url_in_the_environment_is_refused_at_once(monkeypatch) -> None:
    """``recserve train --embedding-workers`` refuses a URL; RECSERVE_EMBEDDING_WORKERS set
    by hand took it, and the trainer failed two minutes later with "Misformatted domain
    name"."""
    from embedding_store.config import GlobalConfig, load_embedding_config
    from embedding_store.errors import InvalidArgumentError
    from training.ctx import make_embedding_tier

    config = load_embedding_config(EMBEDDING_CONFIG)
    monkeypatch.setenv("RECSERVE_EMBEDDING_WORKERS", "http://worker-0:7201/")
    with pytest.raises(InvalidArgumentError) as caught:
        make_embedding_tier(config, GlobalConfig(), None)
    assert caught.value.message == (
        "RECSERVE_EMBEDDING_WORKERS: 'http://worker-0:7201/' is a URL: give HOST:PORT, "
        "without http:// (e.g. worker-0:7201)"
    )
    with pytest.raises(InvalidArgumentError) as caught:
        make_embedding_tier(config, GlobalConfig(), ["grpc://worker-0:7201"])
    assert caught.value.message == (
        "embedding_workers: 'grpc://worker-0:7201' is a URL: give HOST:PORT, without grpc:// "
        "(e.g. worker-0:7201)"
    )


def test_a_url_among_the_infer_servers_is_named_a_url(tmp_path) -> None:
    """It was refused as an IPv6 host without brackets ("write IPv6 hosts as [addr]:port")."""
    from embedding_store.config import load_global_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "global_config.yml"
    path.write_text("common_config: {infer_config: {servers: ['ps-0:7000', 'http://ps-1:7000']}}\n")
    with pytest.raises(ConfigError) as caught:
        load_global_config(path)
    assert caught.value.message == (
        f"{path}: common_config.infer_config.servers[1]: expected a 'host:port' address: "
        "'http://ps-1:7000' is a URL: give HOST:PORT, without http:// (e.g. ps-1:7000)"
    )


# --------------------------------------------------------------------------- serve's preprocessor
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # Not callable: every friendly request got 400 "instances could not be preprocessed:
        # 'str' object is not callable", blaming the client for the server's flag.
        ("os:sep", "--preprocessor 'os:sep' is not a function: got a str"),
        ("no_such_module_here:f",
         "cannot import preprocessor 'no_such_module_here:f': No module named "
         "'no_such_module_here'"),
    ],
)  # fmt: skip
def test_a_bad_preprocessor_is_refused_before_the_model_loads(tmp_path, spec, message) -> None:
    """The checkpoint here does not exist: the preprocessor is refused first (it was
    imported after the model load, which can take minutes, in every --workers process)."""
    from embedding_store.errors import InvalidArgumentError
    from serving.options import ServeOptions
    from serving.server import PredictionServer

    options = ServeOptions(checkpoint=tmp_path / "missing", preprocessor=spec, http_port=0)
    with pytest.raises(InvalidArgumentError) as caught:
        PredictionServer(options).start()
    assert caught.value.message == message


# --------------------------------------------------------------------------- eval's mapping
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("id_features: {user: {colum: u}}\n",
         "id_features.user.colum: unknown key; did you mean 'column'? (allowed keys: column, "
         "hash, separator)"),
        ("preprocessor: no_such_module_here:f\n",
         "preprocessor: cannot import 'no_such_module_here:f': No module named "
         "'no_such_module_here'"),
    ],
)  # fmt: skip
def test_eval_reads_its_mapping_before_the_model_loads(tmp_path, text, message) -> None:
    """The checkpoint here does not exist: the mapping is refused first (it was read after
    the model loaded and the server was asked for its metadata)."""
    from clients.eval import EvalOptions, run_eval
    from embedding_store.errors import ConfigError

    data = tmp_path / "rows.csv"
    data.write_text("u,y\n1,0\n")
    mapping = tmp_path / "feature_mapping.yml"
    mapping.write_text(text)
    options = EvalOptions(
        data=(data,), out=tmp_path / "preds.csv", checkpoint=tmp_path / "missing",
        mapping=mapping, progress=False,
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        run_eval(options)
    assert caught.value.message == f"{mapping}: {message}"
    assert not (tmp_path / "preds.csv").exists()


# --------------------------------------------------------------------------- empty peer lists
@pytest.mark.parametrize(
    "argv",
    [
        ["embedding-tier", "status", "--worker"],
        ["train", "--entry", "t.py", "--embedding-workers"],
    ],
)
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_grpc_address_list_is_refused(capsys, argv, value) -> None:
    """``--worker "$WORKER"`` with WORKER unset: gRPC failed on the empty target with a C++
    source trace; a trainer took "" for no flag and trained its embedded tier alone."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*argv, value])
    assert exited.value.code == 2
    command = " ".join(argv[:2]) if argv[0] == "embedding-tier" else argv[0]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"recserve {command}: error: argument {argv[-1]}: give at least one HOST:PORT"
    )


# --------------------------------------------------------------------------- shipped configs
def test_every_shipped_config_loads_with_the_strict_loaders(tmp_path) -> None:
    """Every config file in the repository, and each file of the Kubernetes ConfigMap, reads
    with recserve's own loaders (duplicate keys and YAML 1.1 number quirks refused), not
    only with ``yaml.safe_load``, which keeps the last of two duplicate keys."""
    import yaml

    from clients.eval_mapping import load_mapping
    from embedding_store.config import load_embedding_config, load_global_config

    loaders = {
        "embedding_config": load_embedding_config,
        "global_config": load_global_config,
        "feature_mapping": load_mapping,
    }
    files = sorted(
        path
        for pattern in ("examples/**/*.yml", "deploy/configs/*.yml")
        for path in ROOT.glob(pattern)
    )
    loaded = []
    for path in files:
        kind = next(kind for kind in loaders if path.name.startswith(kind))
        loaders[kind](path)
        loaded.append(str(path.relative_to(ROOT)))
    configmap = yaml.safe_load((ROOT / "deploy/k8s/configmap.yaml").read_text())
    for name, text in sorted(configmap["data"].items()):
        copy = tmp_path / name
        copy.write_text(text)
        loaders[name.split(".")[0]](copy)
        loaded.append(f"ConfigMap {name}")
    assert loaded == [
        "deploy/configs/embedding_config.yml",
        "deploy/configs/global_config.infer.yml",
        "deploy/configs/global_config.train.yml",
        "examples/adult_income/embedding_config.yml",
        "examples/adult_income/feature_mapping.yml",
        "examples/configs/embedding_config.yml",
        "examples/configs/global_config.yml",
        "ConfigMap embedding_config.yml",
        "ConfigMap global_config.infer.yml",
        "ConfigMap global_config.train.yml",
    ]


# --------------------------------------------------------------------------- config file size
def test_a_config_path_that_names_a_huge_file_is_refused_unread(tmp_path) -> None:
    """A mistyped path (a checkpoint's safetensors file, /dev/zero) was read whole into
    memory before it failed to decode or parse; /dev/zero never ended."""
    from embedding_store.config import load_embedding_config, load_global_config
    from embedding_store.config.strict import MAX_CONFIG_BYTES
    from embedding_store.errors import ConfigError

    assert MAX_CONFIG_BYTES == 16 * 2**20
    huge = tmp_path / "dim_16.safetensors"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk written
    with pytest.raises(ConfigError) as caught:
        load_embedding_config(huge)
    assert caught.value.message == f"{huge}: larger than 16 MiB, expected a YAML config file"
    with pytest.raises(ConfigError) as caught:
        load_global_config("/dev/zero")
    assert caught.value.message == "/dev/zero: larger than 16 MiB, expected a YAML config file"
    # Windows line ends and a byte-order mark read as before the bounded read.
    crlf = tmp_path / "embedding_config.yml"
    crlf.write_bytes(b"\xef\xbb\xbfslots_config:\r\n  a: {dim: 8}\r\n")
    assert load_embedding_config(crlf).slot("a").dim == 8


# --------------------------------------------------------------------------- configs by variable
def test_a_config_given_by_its_variable_is_named_with_it(tmp_path, monkeypatch) -> None:
    """A bad file that no flag named came from RECSERVE_EMBEDDING_CONFIG or
    RECSERVE_GLOBAL_CONFIG (set in a shell or an .env file long ago): its errors name the
    variable as well as the file, key and value. A path given explicitly reads as before."""
    from embedding_store.config import load_embedding_config, load_global_config
    from embedding_store.errors import ConfigError

    embedding = tmp_path / "embedding_config.yml"
    embedding.write_text("slots_config: {a: {dim: 0}}\n")
    glob = tmp_path / "global_config.yml"
    glob.write_text("embedding_worker_config: {forward_buffer_sise: 7}\n")
    monkeypatch.setenv("RECSERVE_EMBEDDING_CONFIG", str(embedding))
    monkeypatch.setenv("RECSERVE_GLOBAL_CONFIG", str(glob))
    with pytest.raises(ConfigError) as caught:
        load_embedding_config()
    assert caught.value.message == (
        f"{embedding} (from RECSERVE_EMBEDDING_CONFIG): slots_config.a.dim: expected a "
        "positive integer, got 0"
    )
    with pytest.raises(ConfigError) as caught:
        load_global_config()
    assert caught.value.message == (
        f"{glob} (from RECSERVE_GLOBAL_CONFIG): embedding_worker_config.forward_buffer_sise: "
        "unknown key; did you mean 'forward_buffer_size'? (allowed keys: forward_buffer_size)"
    )
    with pytest.raises(ConfigError) as caught:
        load_embedding_config(embedding)
    assert caught.value.message.startswith(f"{embedding}: slots_config.a.dim: ")


# --------------------------------------------------------------------------- deploy scripts
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # No time is >= a NaN deadline: it retried every 0.5 s forever.
        (["--wait", "nan"], "argument --wait: expected a finite number of seconds >= 0, got 'nan'"),
        (["--wait", "-1"], "argument --wait: expected a finite number of seconds >= 0, got '-1'"),
        (["--timeout", "0"],
         "argument --timeout: expected a finite number of seconds > 0, got '0'"),
        (["--timeout", "inf"],
         "argument --timeout: expected a finite number of seconds > 0, got 'inf'"),
        (["--wait", "2m"], "argument --wait: expected a finite number of seconds >= 0, got '2m'"),
    ],
)  # fmt: skip
def test_healthcheck_seconds_are_finite(capsys, argv, message) -> None:
    health = load_script(Path("deploy/scripts/healthcheck.py"), "recserve_healthcheck")
    with pytest.raises(SystemExit) as exited:
        health.parse_args(["tcp://127.0.0.1:1", *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1] == message
    args = health.parse_args(["tcp://127.0.0.1:1", "--wait", "120", "--timeout", "0.5"])
    assert (args.wait, args.timeout) == (120.0, 0.5)


def test_nn_worker_addresses_must_match_the_world_size(monkeypatch) -> None:
    """Under torchrun (WORLD_SIZE set) one address per rank: with 3 for 2 ranks, the
    loaders sent a third of the batches to a receiver nobody started."""
    from embedding_store.errors import InvalidArgumentError
    from training.data import StreamingDataset

    monkeypatch.setenv("RECSERVE_NN_WORKER_ADDRESSES", "127.0.0.1:7000,127.0.0.1:7001,b:7002")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(InvalidArgumentError) as caught:
        StreamingDataset()
    assert caught.value.message == (
        "RECSERVE_NN_WORKER_ADDRESSES has 3 address(es) but WORLD_SIZE is 2: give one "
        "HOST:PORT per NN worker, in rank order"
    )
    monkeypatch.setenv("RECSERVE_NN_WORKER_ADDRESSES", "127.0.0.1:7000,127.0.0.1:7001")
    dataset = StreamingDataset()  # not started: nothing to close
    assert (dataset.port, dataset._rank, dataset._world) == (7001, 1, 2)
