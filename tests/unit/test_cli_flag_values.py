"""Flag values (empty paths, tier addresses, addresses given twice, flags with no effect) and
config files Python cannot read. Each test named for a refusal fails without its fix; the
tests of what is taken pin the valid values beside them.

An unset shell variable turns ``--flag "$VAR"`` into ``--flag ""``: a path flag then named
the working directory (``Path("") == Path(".")``), a config flag failed with
": config file not found" or was skipped for its environment variable's file, and a tier
address flag silently chose the embedded tier. Tier addresses gRPC cannot dial (``::1:7000``
is dialled on port 443) were taken by the flags; YAML files that Python cannot read
(nesting, huge integers) ended in tracebacks."""

from __future__ import annotations

import pytest

from embedding_store.cli import build_parser


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The last line of the argparse error of ``recserve ARGV`` (asserting exit code 2)."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


EMPTY_PATH = "expected a path, got an empty value"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        # Was Path("."): the working directory became the root POST /admin/reload may load.
        (["serve", "--checkpoint", "c", "--reload-root", ""], "--reload-root"),
        (["serve", "--checkpoint", " "], "--checkpoint"),
        (["serve", "--checkpoint", "c", "--admin-token-file", ""], "--admin-token-file"),
        (["serve", "--checkpoint", "c", "--tls-cert", ""], "--tls-cert"),
        (["checkpoint", "reshard", "c", "--shards", "2", "--out", ""], "--out"),
        (["checkpoint", "inspect", ""], "DIR"),
        (["eval", "--data", "d.csv", "--out", "p.csv", "--mapping", ""], "--mapping"),
        (["predict", "--input", "r.jsonl", "--tls-ca", ""], "--tls-ca"),
        # Was ": config file not found" (no flag, no file name).
        (["embedding-worker", "--embedding-config", ""], "--embedding-config"),
        (["embedding-worker", "--global-config", ""], "--global-config"),
        (
            ["embedding-parameter-server", "--replica-index", "0", "--replica-size", "1",
             "--port", "0", "--embedding-config", ""],
            "--embedding-config",
        ),
        # Was skipped: the script then read $RECSERVE_EMBEDDING_CONFIG's file, or none.
        (["train", "--entry", "t.py", "--embedding-config", ""], "--embedding-config"),
        (["data-loader", "--entry", "t.py", "--replica-index", "0", "--replica-size", "1",
          "--global-config", ""], "--global-config"),
        (["embedding-tier", "status", "--worker", "w:1", "--embedding-config", ""],
         "--embedding-config"),
    ],
)  # fmt: skip
def test_an_empty_path_is_refused_naming_the_flag(capsys, argv, flag) -> None:
    assert usage_error(capsys, argv).endswith(f"error: argument {flag}: {EMPTY_PATH}")


def test_a_path_with_text_is_taken_as_given() -> None:
    args = build_parser().parse_args(["serve", "--checkpoint", "runs/c", "--reload-root", "runs"])
    assert (str(args.checkpoint), str(args.reload_root)) == ("runs/c", "runs")
    args = build_parser().parse_args(["embedding-worker", "--embedding-config", "e.yml"])
    assert args.embedding_config == "e.yml"


@pytest.mark.parametrize("flag", ["--embedding-workers", "--embedding-ps"])
@pytest.mark.parametrize("value", ["", " ", ","])
def test_serve_refuses_an_empty_tier_address_list(capsys, flag, value) -> None:
    """``--embedding-workers "$WORKER"`` with WORKER unset served from an embedded tier (the
    checkpoint's rows in this process) instead of the remote one, without a word."""
    error = usage_error(capsys, ["serve", "--checkpoint", "c", flag, value])
    assert error.endswith(
        f"error: argument {flag}: give at least one HOST:PORT (leave the flag out for the "
        "embedded tier)"
    )


def test_serve_without_tier_flags_is_embedded() -> None:
    from serving.commands import check_arguments

    args = build_parser().parse_args(["serve", "--checkpoint", "c"])
    assert (args.embedding_workers, args.embedding_ps) == (None, None)
    assert check_arguments(args) is None
    args = build_parser().parse_args(["serve", "--checkpoint", "c", "--embedding-ps", "a:1,b:2"])
    assert check_arguments(args) is None


# --------------------------------------------------------------------------- tier addresses
IPV6_BARE = "'::1:7000' is not HOST:PORT: write an IPv6 host in brackets, e.g. [::1]:7000"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["embedding-worker", "--ps"], "--ps"),
        (["train", "--entry", "t.py", "--nn-worker-addresses"], "--nn-worker-addresses"),
    ],
)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        # gRPC dialled ::1:7000 on port 443: the worker waited out --startup-timeout.
        ("127.0.0.1:7001,::1:7000", IPV6_BARE),
        ("[]:7000", "'[]:7000' is not HOST:PORT: [] holds no IPv6 address"),
        ("[ps-0]:7000", "'[ps-0]:7000' is not HOST:PORT: [ps-0] holds no IPv6 address"),
        ("ps 0:7000", "'ps 0:7000' is not HOST:PORT: the host has a space in it"),
    ],
)
def test_host_port_flags_refuse_what_cannot_be_dialled(capsys, argv, flag, value, message) -> None:
    error = usage_error(capsys, [*argv, value])
    assert error.endswith(f"error: argument {flag}: {message}"), error


def test_host_port_flags_take_ipv6_hosts_in_brackets() -> None:
    value = "[::1]:7000,[fe80::1%eth0]:7001,ps-0.ps:7002,10.0.0.5:65535"
    assert build_parser().parse_args(["embedding-worker", "--ps", value]).ps == value.split(",")


@pytest.mark.parametrize("flag", ["--embedding-ps", "--embedding-workers"])
def test_serve_refuses_a_bare_ipv6_tier_address(flag) -> None:
    from serving.commands import check_arguments

    args = build_parser().parse_args(["serve", "--checkpoint", "c", flag, "::1:7000"])
    assert check_arguments(args) == f"{flag}: {IPV6_BARE}"
    args = build_parser().parse_args(["serve", "--checkpoint", "c", flag, "[::1]:7000"])
    assert check_arguments(args) is None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["embedding-tier", "status", "--worker"], "--worker"),
        (["train", "--entry", "t.py", "--embedding-workers"], "--embedding-workers"),
    ],
)
def test_grpc_address_flags_refuse_a_bare_ipv6_address(capsys, argv, flag) -> None:
    """gRPC target URIs (dns:///h:1, ipv6:[::1]:7000) pass; a bare IPv6 address, which gRPC
    dials on port 443, does not."""
    error = usage_error(capsys, [*argv, "fe80::1"])
    assert error.endswith(
        f"error: argument {flag}: 'fe80::1' is an IPv6 address without a port: write the host "
        "in brackets, [ADDRESS]:PORT"
    )
    for value in ("[::1]:7000", "dns:///w:1", "ipv6:[::1]:7000"):
        assert build_parser().parse_args([*argv, value])


def test_embedding_tier_takes_one_worker(capsys) -> None:
    """A list was dialled as one target: "errors resolving a:1,b:2 ... Misformatted domain
    name"."""
    error = usage_error(capsys, ["embedding-tier", "dump", "d", "--worker", "w0:1,w1:1"])
    assert error.endswith("error: argument --worker: give one HOST:PORT, got 2: 'w0:1,w1:1'")
    args = build_parser().parse_args(["embedding-tier", "status", "--worker", " w0:1 "])
    assert args.worker == "w0:1"


def test_an_embedding_workers_variable_with_a_bare_ipv6_address_is_refused(monkeypatch) -> None:
    from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
    from embedding_store.errors import InvalidArgumentError
    from training.ctx import make_embedding_tier

    monkeypatch.setenv("RECSERVE_EMBEDDING_WORKERS", "::1:7100")
    config = EmbeddingConfig(slots_config={"a": SlotConfig(dim=2)})
    with pytest.raises(InvalidArgumentError) as refused:
        make_embedding_tier(config, GlobalConfig(), None)
    assert refused.value.message == (
        "RECSERVE_EMBEDDING_WORKERS: '::1:7100' is an IPv6 address without a port: write the "
        "host in brackets, [ADDRESS]:PORT"
    )


@pytest.mark.parametrize(
    ("server", "detail"),
    [
        ("[]:7000", "'[]:7000' is not HOST:PORT: [] holds no IPv6 address"),
        ("ps 0:7000", "'ps 0:7000' is not HOST:PORT: the host has a space in it"),
    ],
)
def test_infer_servers_refuse_what_the_flags_refuse(tmp_path, server, detail) -> None:
    from embedding_store.config import load_global_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "global_config.yml"
    path.write_text(f"common_config:\n  infer_config:\n    servers: ['ps-0:7000', '{server}']\n")
    with pytest.raises(ConfigError) as refused:
        load_global_config(path)
    assert refused.value.message == (
        f"{path}: common_config.infer_config.servers[1]: expected a 'host:port' address: {detail}"
    )


# --------------------------------------------------------------------------- the strict loader
def test_a_bad_item_of_a_list_in_a_union_field_is_named(tmp_path) -> None:
    """``positive: [yes, '1']`` (a str | list[str] | None field) read "label.positive:
    expected str or list or null, got [True, '1'] (list)": a list was said not to be a list,
    and neither the item nor the YAML boolean was named."""
    from clients.eval_mapping import load_mapping
    from embedding_store.errors import ConfigError

    path = tmp_path / "feature_mapping.yml"
    head = "id_features:\n  a: {column: a}\nlabel:\n  column: y\n"
    path.write_text(head + "  positive: ['>50K', yes]\n")
    with pytest.raises(ConfigError) as refused:
        load_mapping(path)
    assert refused.value.message == (
        f"{path}: label.positive[1]: expected a string, got True (boolean): YAML reads unquoted "
        "yes/no/on/off/true/false as booleans; quote it for a string (e.g. 'no')"
    )
    # A value of no arm's shape is still described by the union.
    path.write_text(head + "  positive: 1\n")
    with pytest.raises(ConfigError) as refused:
        load_mapping(path)
    assert refused.value.message == (
        f"{path}: label.positive: expected str or list or null, got 1 (integer): quote it for "
        "a string"
    )
    path.write_text(head + "  positive: ['>50K', 'yes']\n")
    assert load_mapping(path).label.positive == [">50K", "yes"]


# --------------------------------------------------------------------------- recserve train
@pytest.mark.parametrize(
    ("addresses", "ranks", "count"),
    [
        ("h0:7500,h1:7500", ["--nproc-per-node", "1"], "2 address(es) for 1 NN worker(s) "
         "(--nproc-per-node 1 x --nnodes 1)"),
        ("h0:7500,h0:7501", ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1"],
         "2 address(es) for 4 NN worker(s) (--nproc-per-node 2 x --nnodes 2)"),
    ],
)  # fmt: skip
def test_train_needs_one_nn_worker_address_per_rank(
    tmp_path, monkeypatch, addresses, ranks, count
) -> None:
    """Rank r listens on entry r of --nn-worker-addresses and the data loaders spread their
    batches over every entry: a list longer than the ranks sent batches to ports no rank
    listened on, a shorter one made ranks share an entry; torchrun started either way."""
    import os

    monkeypatch.delenv("RECSERVE_EMBEDDING_WORKERS", raising=False)
    started: list[list[str]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append(argv))
    entry = tmp_path / "train.py"
    entry.write_text("")
    tier = ["--embedding-workers", "w:7100"]
    args = build_parser().parse_args(
        ["train", "--entry", str(entry), *tier, *ranks, "--nn-worker-addresses", addresses]
    )
    with pytest.raises(SystemExit) as refused:
        args.handler(args)
    assert str(refused.value) == (
        f"recserve train: error: --nn-worker-addresses lists {count}: give one per NN worker, "
        "in rank order"
    )
    assert started == []
    args = build_parser().parse_args(
        ["train", "--entry", str(entry), *tier, "--nproc-per-node", "2",
         "--nn-worker-addresses", "h0:7500, h0:7501"]
    )  # fmt: skip
    args.handler(args)
    assert len(started) == 1


# --------------------------------------------------------------------------- tier token
def test_a_tier_token_variable_and_file_that_disagree_are_refused(tmp_path, monkeypatch) -> None:
    """Both set: the variable won silently, so a process whose token file was rotated kept
    sending the old token from a stale variable, and its peers refused every call."""
    from embedding_store.errors import InvalidArgumentError
    from embedding_store.grpc_common import tier_token

    secret = tmp_path / "token"
    secret.write_text("rotated\n")
    monkeypatch.setenv("RECSERVE_TIER_TOKEN", "stale")
    monkeypatch.setenv("RECSERVE_TIER_TOKEN_FILE", str(secret))
    with pytest.raises(InvalidArgumentError) as refused:
        tier_token()
    assert refused.value.message == (
        f"RECSERVE_TIER_TOKEN and RECSERVE_TIER_TOKEN_FILE={secret} are both set, to different "
        "tokens: set only one"
    )
    monkeypatch.setenv("RECSERVE_TIER_TOKEN", "rotated")  # the same token twice: no conflict
    assert tier_token() == "rotated"
    monkeypatch.delenv("RECSERVE_TIER_TOKEN_FILE")
    assert tier_token() == "rotated"


# --------------------------------------------------------------------------- embedding config
def test_a_slot_named_like_another_slots_lengths_input_is_refused(tmp_path) -> None:
    """Slots ``hist`` and ``hist.lengths`` loaded and trained; serving the model then failed
    (a jagged ``hist`` sends its lengths as input ``hist.lengths``): "rename it in the
    training data and train again"."""
    from embedding_store.config import load_embedding_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "embedding_config.yml"
    path.write_text("slots_config:\n  hist: {dim: 8}\n  hist.lengths: {dim: 4}\n")
    with pytest.raises(ConfigError) as refused:
        load_embedding_config(path)
    assert refused.value.message == (
        f"{path}: slots_config.hist.lengths: slot 'hist.lengths' is named like the '.lengths' "
        "input of slot 'hist', which KServe v2 requests send as the lengths of a jagged ID "
        "feature; rename one of them"
    )
    path.write_text("slots_config:\n  hist: {dim: 8}\n  clicks.lengths: {dim: 4}\n")
    assert load_embedding_config(path).slot_names == ("hist", "clicks.lengths")


# --------------------------------------------------------------------------- parameter server
@pytest.mark.parametrize("job_type", ["Train", "Eval"])
def test_a_shard_that_will_not_load_the_infer_checkpoint_says_so(caplog, job_type) -> None:
    """infer_config.embedding_checkpoint set without `job_type: Infer` (it defaults to Train)
    was ignored without a word: the shard served fresh random rows, trainable."""
    import logging

    from embedding_store.config import EmbeddingConfig, SlotConfig, global_config_from_mapping
    from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess

    config = EmbeddingConfig(slots_config={"a": SlotConfig(dim=2)})
    common = {"job_type": job_type, "infer_config": {"embedding_checkpoint": "/ckpt/e"}}
    global_config = global_config_from_mapping(
        {"common_config": common, "embedding_parameter_server_config": {"capacity": 16}}
    )
    process = ParameterServerProcess(config, global_config, ParameterServerOptions(port=0))
    with caplog.at_level(logging.WARNING, logger="embedding_store.ps_process"):
        assert process._checkpoint_at_start() == (None, True)
    assert [r.getMessage() for r in caplog.records] == [
        f"infer_config.embedding_checkpoint /ckpt/e is not loaded: job_type is {job_type}, and "
        "only job_type Infer shards load it (a training shard loads --load-checkpoint)"
    ]


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path) -> None:
    """PyYAML composes nested nodes recursively: a few hundred levels ended the command in a
    RecursionError traceback instead of one line naming the file."""
    from embedding_store.config import load_embedding_config, load_global_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "deep.yml"
    for text, load in (
        ("slots_config: " + "[" * 1000 + "]" * 1000 + "\n", load_embedding_config),
        ("common_config:\n" + "".join(" " * depth + "a:\n" for depth in range(1, 1000)),
         load_global_config),
    ):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ConfigError) as refused:
            load(path)
        assert refused.value.message == (
            f"{path}: nested too deeply to read (lists or mappings hundreds of levels deep), "
            "expected a YAML config file"
        )


@pytest.mark.parametrize("number", ["9" * 5000, "0x" + "f" * 4000])
def test_an_integer_too_long_for_python_to_print_is_a_config_error(tmp_path, number) -> None:
    """Python refuses integers of more than 4300 decimal digits (to parse, or to print in a
    message): a ValueError traceback instead of one line naming the file and the line."""
    from embedding_store.config import load_embedding_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "embedding_config.yml"
    path.write_text(f"slots_config:\n  a: {{dim: {number}}}\n")
    with pytest.raises(ConfigError) as refused:
        load_embedding_config(path)
    assert refused.value.message == (
        f"{path}: YAML syntax error at line 2, column 12: integer of {len(number)} characters, "
        "too large for any config value"
    )
    path.write_text(f"slots_config:\n  a: {{dim: {'9' * 100}}}\n")  # a long one is named
    with pytest.raises(ConfigError) as refused:
        load_embedding_config(path)
    assert refused.value.message == (
        f"{path}: slots_config.a.dim: expected at most 65536, got {'9' * 77}..."
    )


def test_a_control_character_is_named_with_its_line_and_column(tmp_path) -> None:
    """It read 'invalid YAML: unacceptable character #x0007: special characters are not
    allowed\\n  in "<unicode string>", position 17': two lines, and a position no editor
    shows."""
    from embedding_store.config import load_embedding_config
    from embedding_store.errors import ConfigError

    path = tmp_path / "embedding_config.yml"
    path.write_bytes(b"slots_config:\n  a: {dim: 8}\n  b\x07: {dim: 8}\n")
    with pytest.raises(ConfigError) as refused:
        load_embedding_config(path)
    assert refused.value.message == (
        f"{path}: YAML syntax error at line 3, column 4: character '\\x07' (#x0007) is not "
        "allowed in YAML"
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["embedding-worker", "--ps"], "--ps"),
        (["data-loader", "--entry", "t.py", "--replica-index", "0", "--replica-size", "1",
          "--nn-worker-addresses"], "--nn-worker-addresses"),
    ],
)  # fmt: skip
def test_an_address_given_twice_is_refused(capsys, argv, flag) -> None:
    """infer_config.servers refused a shard listed twice; --ps took it (the worker failed
    only once that shard reported another replica index), and --nn-worker-addresses made
    two ranks listen on one port."""
    error = usage_error(capsys, [*argv, "ps-0:7000,ps-1:7000, ps-0:7000"])
    assert error.endswith(f"error: argument {flag}: 'ps-0:7000' is given twice")


def test_serve_refuses_a_shard_given_twice() -> None:
    from serving.commands import check_arguments

    argv = ["serve", "--checkpoint", "c", "--embedding-ps", "ps-0:7000,ps-0:7000"]
    assert check_arguments(build_parser().parse_args(argv)) == (
        "--embedding-ps: 'ps-0:7000' is given twice"
    )


# --------------------------------------------------------------------------- flags that did nothing
def test_serve_warns_at_start_of_settings_that_have_no_effect(monkeypatch, caplog) -> None:
    """--fallback-policy and --lookup-timeout with the embedded tier, --tls-reload-seconds
    without TLS: harmless, but silently ignored; now each is a warning naming the flag."""
    import serving.server

    started: list[object] = []
    monkeypatch.setattr(serving.server, "serve", lambda options: started.append(options) or 0)
    extra = ["--fallback-policy", "default", "--lookup-timeout", "2", "--tls-reload-seconds", "5"]
    args = build_parser().parse_args(["serve", "--checkpoint", "c", *extra])
    with caplog.at_level("WARNING", logger="serving.commands"):
        assert args.handler(args) == 0
    embedded = (
        "with the embedded tier (no --embedding-workers or --embedding-ps): its lookups run "
        "in this process and never time out"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "serving.commands"] == [
        f"--fallback-policy default has no effect {embedded}",
        f"--lookup-timeout 2 has no effect {embedded}",
        "--tls-reload-seconds 5 has no effect without --tls-cert and --tls-key: the server "
        "speaks plaintext",
    ]
    caplog.clear()
    for argv in (
        ["--embedding-ps", "h:7000", *extra[:4]],
        ["--embedding-workers", "h:7000", *extra[:4]],
        [],  # the defaults
    ):
        args = build_parser().parse_args(["serve", "--checkpoint", "c", *argv])
        with caplog.at_level("WARNING", logger="serving.commands"):
            assert args.handler(args) == 0
    assert [r for r in caplog.records if r.name == "serving.commands"] == []
    assert len(started) == 4


def test_eval_refuses_a_tolerance_without_compare(capsys) -> None:
    """A parity gate written without --compare passed every time, comparing nothing."""
    from embedding_store.cli import main

    argv = ["eval", "--data", "d.csv", "--out", "p.csv", "--checkpoint", "c"]
    assert main([*argv, "--tolerance", "0.001"]) == 1
    assert capsys.readouterr().err == (
        "recserve eval: error: --tolerance 0.001 is for --compare (the parity check of "
        "--checkpoint against --url); without --compare nothing is compared\n"
    )


def test_train_refuses_a_master_addr_on_one_node_without_a_port(tmp_path, monkeypatch) -> None:
    """One node without --master-port runs torchrun --standalone, which ignored the address:
    a forgotten --nnodes trained alone."""
    import os

    monkeypatch.delenv("RECSERVE_EMBEDDING_WORKERS", raising=False)
    started: list[list[str]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append(argv))
    entry = tmp_path / "train.py"
    entry.write_text("")
    base = ["train", "--entry", str(entry), "--master-addr", "10.0.0.5"]
    args = build_parser().parse_args(base)
    with pytest.raises(SystemExit) as refused:
        args.handler(args)
    assert str(refused.value) == (
        "recserve train: error: --master-addr 10.0.0.5 is not used on one node (the rendezvous "
        "runs here): give --nnodes N for a job of several nodes, or --master-port to meet at "
        "that address, or leave --master-addr out"
    )
    assert started == []
    tier = ["--embedding-workers", "w:7100"]
    for argv in (["--master-port", "29501"], ["--nnodes", "2", *tier]):
        args = build_parser().parse_args([*base, *argv])
        args.handler(args)
        assert "--master-addr=10.0.0.5" in started[-1]
    assert len(started) == 2
