"""``--dump-root`` / ``--load-root``: the directories a parameter server's Dump and Load RPCs
take from the network are bound to the roots the operator chose (symlinks resolved, the
resolved path used), PERMISSION_DENIED otherwise; without the flags, any (with a warning)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from embedding_store import checkpoint_dump
from embedding_store.cli import main as cli_main
from embedding_store.config import GlobalConfig
from embedding_store.errors import InvalidArgumentError
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from embedding_store.ps_service import ParameterServerServicer
from tests.unit.test_ps_service import ADAGRAD, CONFIG, FakeContext, aborted, trained

REPO = Path(__file__).resolve().parents[2]


def rooted(s: ParameterServerServicer, dump_root: Path | None, load_root: Path | None = None):
    """``s`` with the roots a servicer built with them gets (resolved)."""
    return ParameterServerServicer(
        s.shard, CONFIG, job_type=s.job_type, dump_root=dump_root, load_root=load_root
    )


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_dump_writes_only_under_the_dump_root(tmp_path):
    tmp_path = tmp_path.resolve()
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)  # a way out of the root by symlink
    s = rooted(trained(), dump_root=root)

    for asked in (outside / "ckpt", root / "link" / "ckpt", root / ".." / "outside" / "ckpt"):
        failure = aborted(s.Dump, pb.ShardDumpRequest(directory=str(asked)))
        assert failure.code == grpc.StatusCode.PERMISSION_DENIED
        assert failure.details == (
            f"ShardDumpRequest.directory {asked} is outside --dump-root {root}; this "
            f"parameter server dumps into only directories under it (name one under {root}, or "
            "start the parameter servers with a --dump-root that holds this one)"
        )
    assert files_under(outside) == []  # nothing made, not even the directory

    response = s.Dump(pb.ShardDumpRequest(directory=str(root / "a" / "ckpt")), FakeContext())
    assert sorted(f.path for f in response.files) == [
        "shard_00000/dim_4.safetensors",
        "shard_00000/dim_8.safetensors",
    ]
    assert files_under(root / "a" / "ckpt") == [
        "shard_00000",
        "shard_00000/dim_4.safetensors",
        "shard_00000/dim_8.safetensors",
    ]


def test_dump_uses_the_resolved_directory_it_checked(tmp_path, monkeypatch):
    """A symlink in the request's path is resolved once: the checked path is the one written,
    so swapping the link between the check and the write cannot lead out of the root."""
    root = tmp_path.resolve() / "root"
    (root / "real").mkdir(parents=True)
    (root / "link").symlink_to(root / "real")
    s = rooted(trained(), dump_root=root)
    written: list[str] = []
    monkeypatch.setattr(s, "dump_part", lambda directory: written.append(directory) or [])
    s.Dump(pb.ShardDumpRequest(directory=str(root / "link" / "ckpt")), FakeContext())
    assert written == [str(root / "real" / "ckpt")]


def test_load_reads_only_under_the_load_root(tmp_path):
    tmp_path = tmp_path.resolve()
    source = trained()
    for name in ("root/ckpt", "outside/ckpt"):
        entries = source.dump_part(str(tmp_path / name))
        checkpoint_dump.finalize_checkpoint(tmp_path / name, CONFIG, 1, entries, ADAGRAD.to_dict())
    root = tmp_path / "root"
    (root / "link").symlink_to(tmp_path / "outside" / "ckpt")
    target = rooted(trained(), dump_root=None, load_root=root)
    target.shard.clear()
    for asked in (tmp_path / "outside" / "ckpt", root / "link"):
        failure = aborted(target.Load, pb.ShardLoadRequest(directory=str(asked)))
        assert failure.code == grpc.StatusCode.PERMISSION_DENIED
        assert failure.details == (
            f"ShardLoadRequest.directory {asked} is outside --load-root {root}; this "
            f"parameter server loads from only directories under it (name one under {root}, "
            "or start the parameter servers with a --load-root that holds this one)"
        )
    assert target.shard.size() == 0
    loaded = target.Load(pb.ShardLoadRequest(directory=str(root / "ckpt")), FakeContext())
    assert loaded.rows_loaded == 8
    # No roots (the default): any directory, as before.
    free = rooted(trained(), dump_root=None)
    free.shard.clear()
    request = pb.ShardLoadRequest(directory=str(tmp_path / "outside" / "ckpt"))
    assert free.Load(request, FakeContext()).rows_loaded == 8


def test_a_process_without_roots_warns_and_passes_its_roots_on(tmp_path):
    tmp_path = tmp_path.resolve()
    free = ParameterServerProcess(CONFIG, GlobalConfig())
    assert free.root_warnings() == [
        "no --dump-root: Dump RPCs write into any directory this process's user can write "
        "(given by any peer that passes the tier token and network policy); set --dump-root "
        "to the checkpoint volume",
        "no --load-root: Load RPCs read from any directory this process's user can read "
        "(given by any peer that passes the tier token and network policy); set --load-root "
        "to the checkpoint volume",
    ]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "root")
    (tmp_path / "root").mkdir()
    options = ParameterServerOptions(dump_root=str(link), load_root=str(tmp_path))
    bound = ParameterServerProcess(CONFIG, GlobalConfig(), options)
    assert bound.root_warnings() == []
    missing = ParameterServerOptions(dump_root=str(tmp_path / "runs"), load_root=str(tmp_path))
    assert ParameterServerProcess(CONFIG, GlobalConfig(), missing).root_warnings() == [
        f"--dump-root {tmp_path / 'runs'} is not a directory (yet; a typo?): Dump RPCs take "
        "only directories under it all the same"
    ]
    assert bound.servicer.dump_root == tmp_path / "root"
    assert bound.servicer.load_root == tmp_path
    with pytest.raises(InvalidArgumentError, match="dump_root must be a non-empty path"):
        ParameterServerOptions(dump_root="")


def test_cli_passes_the_roots_on_and_refuses_files(tmp_path, monkeypatch, capsys):
    import embedding_store.ps_process as ps_process

    seen: list[ParameterServerOptions | None] = []
    monkeypatch.setattr(
        ps_process, "serve_parameter_server", lambda _e, _g, options: seen.append(options) or 0
    )
    base = [
        "embedding-parameter-server",
        "--embedding-config",
        str(REPO / "deploy" / "configs" / "embedding_config.yml"),
        "--replica-index=0",
        "--replica-size=1",
        "--port=0",
    ]
    assert cli_main([*base, f"--dump-root={tmp_path}", f"--load-root={tmp_path}"]) == 0
    assert seen[0] is not None
    assert (seen[0].dump_root, seen[0].load_root) == (str(tmp_path), str(tmp_path))
    file = tmp_path / "file"
    file.write_text("")
    for flag in ("--dump-root", "--load-root"):
        with pytest.raises(SystemExit) as exit_:
            cli_main([*base, f"{flag}={file}"])
        assert exit_.value.code == 2
        assert f"{flag} {file}: not a directory" in capsys.readouterr().err


def test_a_worker_dump_outside_the_shards_root_writes_no_rows(tmp_path):
    """``recserve embedding-tier dump`` through a worker: the shard (real gRPC, in this
    process) refuses the staging directory outside its root; the worker passes
    PERMISSION_DENIED on, writes no manifest and leaves no staging directory."""
    from concurrent import futures

    from embedding_store import checkpoint_manifest
    from embedding_store.errors import PermissionDeniedError
    from embedding_store.grpc_common import add_servicer, server_options
    from embedding_store.remote_tier import RemoteShardTier

    tmp_path = tmp_path.resolve()
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    servicer = rooted(trained(), dump_root=root, load_root=root)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=server_options())
    add_servicer(server, servicer, "ParameterServer")
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tier = RemoteShardTier(CONFIG, [f"127.0.0.1:{port}"], shard_timeout=10.0)
    try:
        with pytest.raises(PermissionDeniedError) as refused:
            tier.dump(outside / "ckpt")
        message = refused.value.message
        assert message.startswith(f"checkpoint {outside / 'ckpt'} not written (no manifest"), (
            message
        )
        assert message.endswith(
            f"is outside --dump-root {root}; this parameter server dumps into only directories "
            f"under it (name one under {root}, or start the parameter servers with a "
            "--dump-root that holds this one)"
        ), message
        assert files_under(outside) == []
        manifest = tier.dump(root / "ckpt")
        assert sum(f.rows for f in manifest.files) == 8
        checkpoint_manifest.read_manifest(root / "ckpt")
    finally:
        tier.close()
        server.stop(None)
