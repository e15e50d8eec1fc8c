"""``recserve eval`` (in-process, generic mapping) and the checkpoint tools on a tiny checkpoint
built here: two ID slots in one feature group plus an ungrouped one, prefix bits 8."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import safetensors.numpy
import torch
from torch import nn

from clients import checkpoint_common, checkpoint_diff, checkpoint_inspect, checkpoint_write
from clients.eval import EvalOptions, run_eval
from embedding_store import checkpoint_dump, checkpoint_load, checkpoint_manifest, model_checkpoint
from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import (
    AlreadyExistsError,
    CheckpointError,
    ConfigError,
    InvalidArgumentError,
)
from embedding_store.shard import RowBlock
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from embedding_store.tier import InProcessEmbeddingTier

CONFIG = embedding_config_from_mapping(
    {
        "feature_index_prefix_bit": 8,
        "slots_config": {"user": {"dim": 4}, "tags": {"dim": 4}, "item": {"dim": 4}},
        "feature_groups": {"content": ["tags", "item"]},
    }
)
SIGNATURE = FeatureSignature(
    (IdFeatureSpec("user", True), IdFeatureSpec("tags", False)),
    (NonIdFeatureSpec("dense", "float32", (2,)),),
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4 + 4 + 2, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


def make_checkpoint(directory: Path, *, seed: int = 0, users: int = 50) -> Path:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tier = InProcessEmbeddingTier(CONFIG, capacity=10_000)
    ids = np.concatenate(
        [
            CONFIG.prefix_ids("user", np.arange(users, dtype=np.uint64)),
            CONFIG.prefix_ids("tags", np.arange(100, 130, dtype=np.uint64)),
        ]
    )
    weights = rng.normal(size=(ids.size, 4)).astype(np.float32)
    tier.shards[0].import_rows(RowBlock(ids, weights, None))
    model_checkpoint.write_checkpoint(directory, Tiny(), None, tier, step=7, signature=SIGNATURE)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "checkpoint")


def write_rows(path: Path, n: int = 40) -> None:
    rng = np.random.default_rng(5)
    lines = ["user,tags,dense_0,dense_1,clicked"]
    for i in range(n):
        user = i * 2  # users >= 50 are unknown to the checkpoint
        tags = " ".join(str(100 + int(t)) for t in rng.integers(0, 30, i % 3))
        lines.append(f"{user},{tags},{rng.normal():.4f},{rng.normal():.4f},{i % 2}")
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- eval in-process
def test_eval_in_process_with_the_default_mapping(checkpoint, tmp_path, capsys):
    data = tmp_path / "rows.csv"
    write_rows(data)
    options = EvalOptions(  # paths as strings, and one data file alone: as Python callers do
        data=str(data),  # type: ignore[arg-type]
        out=str(tmp_path / "predictions.parquet"),  # type: ignore[arg-type]
        checkpoint=str(checkpoint),  # type: ignore[arg-type]
        label="clicked",
        report=str(tmp_path / "report"),  # type: ignore[arg-type]
        batch_size=16,
        output_transform="sigmoid",
        progress=False,
    )
    assert options.data == (data,) and options.out == tmp_path / "predictions.parquet"
    result = run_eval(options)
    assert result.rows == 40 and result.exit_code == 0
    assert "scored 40 rows" in capsys.readouterr().out

    import pyarrow.parquet as pq

    table = pq.read_table(options.out).to_pydict()
    assert table["position"] == list(range(2, 42))
    # The same rows scored by hand through the TorchScript model and the embedding table.
    manifest = model_checkpoint.read_manifest(checkpoint)
    dense = model_checkpoint.load_jit_model(manifest)
    emb = checkpoint_manifest.read_manifest(manifest.embeddings_directory)
    rows = checkpoint_load.read_rows_for_replica(emb, 0, 1, keep_state_of=None)[0]
    table_of = dict(zip(rows.ids.tolist(), rows.weights))
    zero = np.zeros(4, np.float32)
    expected = []
    for line in data.read_text().splitlines()[1:]:
        user, tags, x, y, _ = line.split(",")
        u = table_of.get(int(CONFIG.prefix_ids("user", np.array([int(user)], np.uint64))[0]), zero)
        t = sum(
            (table_of[int(CONFIG.prefix_ids("tags", np.array([int(v)], np.uint64))[0])]
             for v in tags.split()),
            zero,
        )  # fmt: skip
        with torch.no_grad():
            logit = dense(
                [torch.tensor([[float(x), float(y)]])],
                [torch.from_numpy(np.stack([u])), torch.from_numpy(np.stack([t]))],
            )
        expected.append(float(torch.sigmoid(logit)))
    np.testing.assert_allclose(table["prediction"], expected, rtol=1e-5, atol=1e-6)

    report = json.loads((options.report / "report.json").read_text())
    assert report["counts"] == {"rows": 40, "positives": 20, "negatives": 20, "skipped_rows": 0}
    unknown = report["unknown_ids"]
    user_ids, tag_ids = 40, sum(i % 3 for i in range(40))
    assert unknown["ids"] == user_ids + tag_ids
    assert unknown["unknown"] == 15  # users 50, 52, ..., 78
    assert report["model"]["checkpoint_version"] == manifest.version


def test_eval_option_and_mapping_errors(checkpoint, tmp_path):
    data = tmp_path / "rows.csv"
    write_rows(data, 3)
    base = {"data": (data,), "out": tmp_path / "p.csv", "progress": False}
    with pytest.raises(InvalidArgumentError, match="--compare needs both"):
        run_eval(EvalOptions(**base, checkpoint=checkpoint, compare=True))
    with pytest.raises(InvalidArgumentError, match="give --checkpoint DIR"):
        run_eval(EvalOptions(**base))
    with pytest.raises(InvalidArgumentError, match="no label column 'income'"):
        run_eval(EvalOptions(**base, checkpoint=checkpoint, label="income"))
    mapping = tmp_path / "m.yml"
    mapping.write_text("id_features: {user: {column: user, hash: int}}\n")
    with pytest.raises(ConfigError, match=r"m\.yml: id_features: missing \['tags'\]"):
        run_eval(EvalOptions(**base, checkpoint=checkpoint, mapping=mapping))
    assert not (tmp_path / "p.csv").exists()


def test_eval_outputs_must_not_be_the_checkpoint_or_a_part_of_it(checkpoint, tmp_path):
    """--report DIR/embeddings --overwrite used to replace the checkpoint's embeddings with
    the report: the checkpoint then failed verification and no longer loaded."""
    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    data = tmp_path / "rows.csv"
    write_rows(data, 3)
    for flag, out, report in (
        ("--report", tmp_path / "p.csv", copy / "embeddings"),
        ("--report", tmp_path / "p.csv", copy),
        ("--report", tmp_path / "p.csv", copy / "manifest.json"),
        ("--out", copy / "embeddings" / "shard_00000" / "p.csv", None),
        # The random number generators' file too (replaced, a resume failed its checksum).
        ("--out", copy / "rng_state.safetensors", None),
    ):
        target = report if report is not None else out
        options = EvalOptions(
            data=(data,), out=out, report=report, checkpoint=copy, overwrite=True, progress=False
        )
        with pytest.raises(InvalidArgumentError) as refused:
            run_eval(options, out=io.StringIO())
        assert refused.value.message == (
            f"{flag} {target} is the --checkpoint {copy} or a part of it: writing it would "
            "damage the checkpoint"
        )
    assert checkpoint_inspect.verify(copy)[0] == []
    assert not (tmp_path / "p.csv").exists()
    # A new file next to the checkpoint's own is no part of it.
    options = EvalOptions(data=(data,), out=copy / "p.csv", checkpoint=copy, progress=False)
    assert run_eval(options, out=io.StringIO()).rows == 3
    assert checkpoint_inspect.verify(copy)[0] == []


def test_eval_refuses_a_report_over_a_directory_that_is_no_report_before_scoring(
    checkpoint, tmp_path, monkeypatch
):
    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("mine")
    data = tmp_path / "rows.csv"
    write_rows(data, 3)
    scored = []
    monkeypatch.setattr("clients.eval.InProcessScorer", lambda *a: scored.append(a))
    options = EvalOptions(
        data=(data,),
        out=tmp_path / "p.csv",
        report=results,
        checkpoint=checkpoint,
        overwrite=True,
        progress=False,
    )
    with pytest.raises(AlreadyExistsError, match="is not an eval report"):
        run_eval(options, out=io.StringIO())
    assert scored == [] and (results / "notes.txt").read_text() == "mine"


def test_bad_rows_skip_and_fail(checkpoint, tmp_path, capsys):
    data = tmp_path / "rows.csv"
    data.write_text("user,tags,dense_0,dense_1\n1,,0.5,1\nx,,0.5,1\n2,100,0.1,oops\n3,101,0,0\n")
    base = {"data": (data,), "checkpoint": checkpoint, "progress": False}
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "fail.csv"))
    assert caught.value.message == (
        f"bad rows in {data}: fix them, or pass --bad-rows skip to score the other rows:\n"
        f"  {data}:3: column 'user': 'x' is not an integer ID\n"
        f"  {data}:4: column 'dense_1': 'oops' is not a number"
    )
    assert not (tmp_path / "fail.csv").exists()
    result = run_eval(EvalOptions(**base, out=tmp_path / "skip.csv", bad_rows="skip"))
    assert (result.rows, result.skipped) == (2, 2)
    assert result.report["auc"] is None and result.report["auc_note"] == "no labels"
    assert f"skipped {data}:3: " in capsys.readouterr().err
    assert (tmp_path / "skip.csv").read_text().count("\n") == 3


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_out_that_cannot_be_written_names_the_flag_and_the_path_given(
    checkpoint, tmp_path, capsys
):
    """The error named the hidden temporary file (/proc/.x.csv.tmp-<hex>), not --out."""
    from embedding_store.cli import main

    data = tmp_path / "rows.csv"
    write_rows(data, 3)
    for name in ("x.csv", "x.parquet"):
        argv = ["eval", "--data", str(data), "--checkpoint", str(checkpoint)]
        assert main([*argv, "--out", f"/proc/{name}", "--quiet"]) == 1
        assert capsys.readouterr().err == (
            f"recserve eval: error: --out /proc/{name}: cannot write there: "
            "No such file or directory\n"
        )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_report_that_cannot_be_written_fails_before_scoring(checkpoint, tmp_path, capsys):
    """It failed after the scoring run, naming the hidden staging directory
    (/proc/.r.tmp-<hex>), not --report."""
    from embedding_store.cli import main

    data, out = tmp_path / "rows.csv", tmp_path / "p.csv"
    write_rows(data, 3)
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["eval", "--data", str(data), "--checkpoint", str(checkpoint), "--out", str(out)]
    for report, reason in (("/proc/r", "No such file or directory"),
                           (f"{blocker}/a/r", "Not a directory")):  # fmt: skip
        assert main([*argv, "--report", report, "--quiet"]) == 1
        assert capsys.readouterr() == (
            "",
            f"recserve eval: error: --report {report}: cannot write there: {reason}\n",
        )
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "rows.csv"]  # no probe left


def test_a_report_without_matplotlib_fails_before_scoring(checkpoint, tmp_path, monkeypatch):
    """`recserve eval --report` without the eval extra (the quickstart's environment): it
    scored every row and wrote --out, then failed; the rerun after installing the extra then
    met its own --out ("already exists") unless given --overwrite."""
    data = tmp_path / "rows.csv"
    data.write_text("user,tags,dense_0,dense_1\n1,,0.5,1\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "p.csv"
    options = EvalOptions(
        data=(data,), out=out, checkpoint=checkpoint, report=tmp_path / "r", progress=False
    )
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(options)
    assert caught.value.message == (
        "the eval report's plots need matplotlib (pip install 'recserve[eval]')"
    )
    assert not out.exists() and not (tmp_path / "r").exists()


def test_a_report_that_fails_leaves_no_predictions_behind(checkpoint, tmp_path, monkeypatch):
    """The predictions file was committed before the report was written: a report that
    failed left --out behind, and the rerun met it ("already exists") without --overwrite.
    Now the report is rendered first and both are committed, or neither."""
    from clients import eval_report

    data = tmp_path / "rows.csv"
    write_rows(data, n=8)
    out, report = tmp_path / "p.csv", tmp_path / "r"

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eval_report, "_plots", broken)
    options = EvalOptions(
        data=(data,), out=out, checkpoint=checkpoint, label="clicked", report=report,
        progress=False,
    )  # fmt: skip
    with pytest.raises(OSError, match="No space left on device"):
        run_eval(options)
    # Neither output nor a temporary one: a rerun needs no --overwrite.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]


def test_default_layout_errors_name_the_expected_columns(checkpoint, tmp_path):
    """A new user's CSV: a JSON list in the multi-ID column and the dense values in one
    column. Each error says what the default layout expects."""
    data = tmp_path / "rows.csv"
    data.write_text('user,tags,dense_0,dense_1\n1,"[100, 101]",0.5,1\n2,"[102]",0.5,1\n')
    base = {"data": (data,), "checkpoint": checkpoint, "progress": False}
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv"))
    # The same layout as every bad-row error (bad_rows_message): the file, then each row's
    # file:line and column, and what to do.
    assert caught.value.message == (
        f"bad rows in {data}: none of its first 2 rows could be read and encoded, so "
        "--bad-rows skip would skip them all; check that the columns follow the default "
        "layout (recserve eval --help; recserve checkpoint inspect lists the model's "
        f"features):\n  {data}:2: column 'tags': '[100, 101]' is not a list of integer IDs: "
        "expected IDs separated by spaces, e.g. '71 282 62'\n"
        f"  {data}:3: column 'tags': '[102]' is not a list of integer IDs: expected IDs "
        "separated by spaces, e.g. '71 282 62'"
    )
    with pytest.raises(InvalidArgumentError) as caught:  # skipping them would score nothing
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv", bad_rows="skip"))
    assert caught.value.message.startswith(f"bad rows in {data}: none of its first 2 rows ")
    data.write_text('user,tags,dense\n1,100 101,"[0.5, 1]"\n')
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv"))
    assert (
        f"{data}:2: missing column 'dense_0': non-ID feature 'dense' takes 2 values per row, "
        "one per column: 'dense_0', 'dense_1' (the data has a column 'dense': write each of "
        "its values to its own column)"
    ) in caught.value.message
    data.write_text("user,tags,dense_0,dense_1\n1,100 101,0.5,1\n2,,0.5,1\n")
    assert run_eval(EvalOptions(**base, out=tmp_path / "p.csv")).rows == 2


def test_no_rows_scored_names_the_first_bad_row_or_the_empty_file(checkpoint, tmp_path):
    """Skipping every row (here: every label unreadable, which no mapping fixes) ends in an
    error naming the first bad row, as the other bad-row errors do; a file of a header alone
    is named as such. An ID feature's missing column names the feature, as a non-ID one's."""
    data = tmp_path / "rows.csv"
    data.write_text("user,tags,dense_0,dense_1,clicked\n1,,0.5,1,yes\n2,,0.5,1,no\n")
    base = {"data": (data,), "checkpoint": checkpoint, "progress": False, "label": "clicked"}
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv", bad_rows="skip"))
    assert caught.value.message == (
        f"no rows scored in {data}: all 2 rows are bad rows (the first: {data}:2: label "
        "column 'clicked': 'yes' is not a number); fix them: the skipped rows above say what "
        "is wrong with each"
    )
    data.write_text("user,tags,dense_0,dense_1,clicked\n")
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv"))
    assert caught.value.message == f"no rows scored in {data}: no data rows (a header alone?)"
    data.write_text("id,tags,dense_0,dense_1,clicked\n1,,0.5,1,1\n")
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "p.csv"))
    assert caught.value.message == (
        f"bad rows in {data}: fix them, or pass --bad-rows skip to score the other rows:\n"
        f"  {data}:2: missing column 'user' (ID feature 'user' is read from it)"
    )
    assert not (tmp_path / "p.csv").exists()


# --------------------------------------------------------------------------- checkpoint tools
def test_inspect_text_and_json(checkpoint):
    info = checkpoint_inspect.inspect(checkpoint)
    assert info["step"] == 7 and info["kind"] == "model"
    assert info["embeddings"]["rows_per_id_space"] == {"user": 50, "content": 30}
    slots = {s["name"]: s for s in info["embeddings"]["slots"]}
    assert slots["tags"]["id_space"] == slots["item"]["id_space"] == "content"
    assert slots["tags"]["prefix"] == slots["item"]["prefix"] == "0x0100000000000000"
    text = checkpoint_inspect.format_inspect(info)
    assert "tags[]" in text and "rows per shard 80" in text
    assert "  forward        not loaded: jit_dense.pt is code (--load-code loads it" in text
    # The columns recserve eval reads without --mapping, as README.md says inspect lists them.
    assert (
        "  CSV columns    user, tags (IDs separated by spaces), dense_0, dense_1 (recserve eval "
        "without --mapping)"
    ) in text.splitlines()
    # A non-ID feature of more than 3 values is shown as a range: [2, 3] -> grid_0 .. grid_5.
    wide = FeatureSignature(
        (IdFeatureSpec("user", True),),
        (NonIdFeatureSpec("grid", "float32", (2, 3)), NonIdFeatureSpec("age", "float32", ())),
    )
    assert checkpoint_inspect.csv_columns(wide.to_dict()) == (
        "user, grid_0 .. grid_5, age (recserve eval without --mapping)"
    )
    loaded = checkpoint_inspect.format_inspect(
        checkpoint_inspect.inspect(checkpoint, load_code=True)
    )
    assert "  forward        forward(" in loaded
    # The dense files' sizes line up, rng_state.safetensors' too (longer than the column was).
    files = {**info["dense_files"], "rng_state.safetensors": {"bytes": 5184, "sha256": "ab" * 32}}
    lines = checkpoint_inspect.format_inspect({**info, "dense_files": files}).splitlines()
    start = lines.index("  dense files") + 1
    listed = lines[start : start + len(files)]
    assert [line.split()[0] for line in listed] == list(files)
    assert len({line.index(" bytes  sha256") for line in listed}) == 1, listed


class _CodeOnLoad(torch.nn.Module):
    """TorchScript whose loading runs code: ``__setstate__`` writes ``!!!`` to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.weight = torch.zeros(1)
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[torch.Tensor, str, bool]:
        return (self.weight, self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, str, bool]) -> None:
        self.path = state[1]
        self.training = state[2]
        written = torch.from_file(self.path, shared=True, size=3, dtype=torch.uint8)
        written.fill_(33)
        self.weight = written.float()  # used, or the compiler drops the write


def test_inspect_and_verify_run_no_code_of_the_checkpoint_unless_asked(checkpoint, tmp_path):
    """jit_dense.pt is TorchScript: loading it runs its author's code. Vetting a checkpoint
    from elsewhere (verify, inspect, and reshard and diff, which verify first) must not."""
    import hashlib
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(checkpoint, planted)
    marker = tmp_path / "code-ran"
    jit = planted / "jit_dense.pt"
    torch.jit.script(_CodeOnLoad(str(marker))).save(str(jit))
    manifest = json.loads((planted / "manifest.json").read_text())
    entry = manifest["files"]["jit_dense.pt"]
    entry["bytes"], entry["sha256"] = (
        jit.stat().st_size,
        hashlib.sha256(jit.read_bytes()).hexdigest(),
    )
    (planted / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint_inspect.verify(planted)[0] == []
    checkpoint_inspect.inspect(planted)
    checkpoint_write.reshard(planted, 2, tmp_path / "resharded")
    checkpoint_diff.diff(planted, checkpoint)
    assert not marker.exists()
    assert checkpoint_inspect.verify(planted, load_code=True)[0] == []  # asked: it runs
    assert marker.read_bytes() == b"!!!"


def test_verify_lists_every_problem(checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "opt.pt").unlink(missing_ok=True)
    (broken / "jit_dense.pt").write_bytes(b"junk")
    table = next((broken / "embeddings").rglob("*.safetensors"))
    table.write_bytes(table.read_bytes()[:-1] + b"\x00")
    problems, _ = checkpoint_inspect.verify(broken)
    assert len(problems) == 2, problems
    assert any("jit_dense.pt has 4 bytes" in p for p in problems)
    assert any("SHA-256 mismatch" in p and "safetensors" in p for p in problems)
    assert checkpoint_inspect.verify(tmp_path / "nowhere")[0] == [
        f"checkpoint {tmp_path / 'nowhere'} does not exist or is not a directory"
    ]


def test_reshard_embedding_checkpoint_round_trip_and_diff(checkpoint, tmp_path):
    embeddings = checkpoint / "embeddings"
    three, one = tmp_path / "three", tmp_path / "one"
    result = checkpoint_write.reshard(embeddings, 3, three)
    assert result["kind"] == "embedding" and sum(result["rows_per_shard"]) == 80
    checkpoint_write.reshard(three, 1, one)
    assert checkpoint_diff.diff(embeddings, one)["identical"]
    manifest = checkpoint_manifest.read_manifest(one)
    assert manifest.num_shards == 1 and manifest.total_rows == 80
    # The same rows, sharded otherwise: the version stays (shards report it to servers).
    source_version = checkpoint_manifest.read_manifest(embeddings).version
    assert manifest.version == source_version
    assert checkpoint_manifest.read_manifest(three).version == source_version
    inspected = checkpoint_inspect.format_inspect(checkpoint_inspect.inspect(three))
    assert f"  embedding version {source_version} (what the shards" in inspected
    # Rows land where the hash routing says (loadable by 3 replicas without moving).
    three_manifest = checkpoint_manifest.read_manifest(three)
    from embedding_store.hashing import shard_of

    for entry in three_manifest.files:
        ids = checkpoint_load._read_verified(three_manifest, entry)["ids"]
        assert set(shard_of(ids, 3).tolist()) == {entry.shard}
    with pytest.raises(AlreadyExistsError):
        checkpoint_write.reshard(embeddings, 2, three)
    with pytest.raises(InvalidArgumentError, match="must not be"):
        checkpoint_write.reshard(checkpoint, 2, checkpoint / "inside")
    with pytest.raises(InvalidArgumentError) as caught:
        checkpoint_diff.diff(checkpoint, one)
    assert caught.value.message == (
        f"{checkpoint} is a model checkpoint but {one} is an embedding one"
    )
    with pytest.raises(InvalidArgumentError) as caught:
        checkpoint_diff.diff(one, checkpoint)
    assert caught.value.message == (
        f"{one} is an embedding checkpoint but {checkpoint} is a model one"
    )


def test_diff_counts_added_removed_and_changed_rows(checkpoint, tmp_path):
    other = make_checkpoint(tmp_path / "other", seed=1, users=60)
    result = checkpoint_diff.diff(checkpoint, other)
    spaces = {s["id_space"]: s for s in result["embeddings"]["id_spaces"]}
    assert spaces["user"]["added"] == 10 and spaces["user"]["removed"] == 0
    assert spaces["user"]["changed"] == 50 and spaces["user"]["max_abs_diff"] > 0
    assert spaces["content"]["slots"] == ["tags", "item"]
    assert not result["identical"]
    assert result["dense"]["max_abs_diff"] > 0
    assert {t["status"] for t in result["dense"]["tensors"]} == {"changed"}
    assert "checkpoints differ" in checkpoint_diff.format_diff(result)


def test_diff_counts_optimizer_state_as_a_difference(tmp_path):
    # Same weights, other optimizer state: the checkpoints resume differently.
    from embedding_store.optimizers import Adagrad
    from embedding_store.shard import EmbeddingShard

    ids = CONFIG.prefix_ids("user", np.arange(5, dtype=np.uint64))
    weights = np.arange(20, dtype=np.float32).reshape(5, 4)
    shard = EmbeddingShard(100, optimizer=Adagrad(lr=0.1))
    shard.import_rows(RowBlock(ids, weights, None))
    checkpoint_dump.dump_embeddings([shard], tmp_path / "a", CONFIG)
    block = shard.export_rows(4)
    state = block.state.copy()
    state[2, 0] += 0.5
    other = EmbeddingShard(100, optimizer=Adagrad(lr=0.1))
    other.replace_rows([RowBlock(block.ids, block.weights, state)])
    checkpoint_dump.dump_embeddings([other], tmp_path / "b", CONFIG)
    result = checkpoint_diff.diff(tmp_path / "a", tmp_path / "b")
    (user,) = [s for s in result["embeddings"]["id_spaces"] if s["id_space"] == "user"]
    assert (user["changed"], user["state_changed"]) == (0, 1)
    assert not result["identical"]
    text = checkpoint_diff.format_diff(result)
    assert "state changed" in text and "checkpoints differ" in text
    assert checkpoint_diff.diff(tmp_path / "a", tmp_path / "a")["identical"]

    # The dense optimizer's state (opt.pt), with the same dense weights.
    tier = InProcessEmbeddingTier(CONFIG, capacity=100)
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for name, lr in (("m1", 0.1), ("m2", 0.2)):
        optimizer.param_groups[0]["lr"] = lr
        model_checkpoint.write_checkpoint(
            tmp_path / name, model, optimizer, tier, signature=SIGNATURE
        )
    result = checkpoint_diff.diff(tmp_path / "m1", tmp_path / "m2")
    assert result["dense"]["max_abs_diff"] == 0.0 and not result["identical"]
    assert "opt.pt                         differs (compared by checksum)" in (
        checkpoint_diff.format_diff(result)
    )


class TwiceTiny(Tiny):
    """Tiny's parameters, other code: dense.pt the same, jit_dense.pt not."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return 2 * self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


def test_diff_counts_config_signature_and_dense_code_as_differences(checkpoint, tmp_path):
    # "config DIFFERS" used to come with "identical" (and --exit-code 0): the embedding config,
    # the feature signature and jit_dense.pt were left out of `identical`.
    from embedding_store.cli import main as cli_main

    shutil.copytree(checkpoint, tmp_path / "config")
    manifest_path = tmp_path / "config" / "embeddings" / "embedding_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["embedding_config"]["slots_config"]["tags"]["embedding_summation"] = False
    manifest_path.write_text(json.dumps(manifest))
    result = checkpoint_diff.diff(checkpoint, tmp_path / "config")
    assert not result["embeddings"]["config_identical"] and not result["identical"]
    text = checkpoint_diff.format_diff(result)
    assert "config DIFFERS" in text and text.endswith("\n  checkpoints differ")
    assert cli_main(["checkpoint", "diff", str(checkpoint), str(tmp_path / "config")]) == 0
    argv = ["checkpoint", "diff", "--exit-code", str(checkpoint), str(tmp_path / "config")]
    assert cli_main(argv) == 1
    assert cli_main([*argv[:3], str(checkpoint), str(checkpoint)]) == 0

    tier = InProcessEmbeddingTier(CONFIG, capacity=100)
    torch.manual_seed(3)
    model = Tiny()
    other_signature = FeatureSignature(
        SIGNATURE.id_features, (NonIdFeatureSpec("x", "float32", (2,)),)
    )
    twice = TwiceTiny()
    twice.load_state_dict(model.state_dict())
    for name, module, signature in (
        ("base", model, SIGNATURE),
        ("same", model, SIGNATURE),
        ("signature", model, other_signature),
        ("code", twice, SIGNATURE),
    ):
        model_checkpoint.write_checkpoint(tmp_path / name, module, None, tier, signature=signature)
    assert checkpoint_diff.diff(tmp_path / "base", tmp_path / "same")["identical"]

    result = checkpoint_diff.diff(tmp_path / "base", tmp_path / "signature")
    assert result["dense"]["max_abs_diff"] == 0.0 and not result["dense"]["signature_identical"]
    assert not result["identical"]
    assert "signature DIFFERS" in checkpoint_diff.format_diff(result)

    result = checkpoint_diff.diff(tmp_path / "base", tmp_path / "code")
    assert result["dense"]["max_abs_diff"] == 0.0
    assert result["dense"]["files_identical"] == {
        "dense.pt": True,
        "jit_dense.pt": False,
    }
    assert not result["identical"]
    text = checkpoint_diff.format_diff(result)
    assert "    jit_dense.pt                   differs (compared by checksum)" in text
    assert text.endswith("\n  checkpoints differ")


def test_export_dense(checkpoint, tmp_path):
    out = tmp_path / "dense.pt"
    info = checkpoint_write.export_dense(checkpoint, out)
    assert (
        info["sha256"] == model_checkpoint.read_manifest(checkpoint).files["jit_dense.pt"]["sha256"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(io.BytesIO(out.read_bytes()))
    output = module([torch.zeros(3, 2)], [torch.zeros(3, 4), torch.zeros(3, 4)])
    assert tuple(output.shape) == (3, 1)
    with pytest.raises(AlreadyExistsError):
        checkpoint_write.export_dense(checkpoint, out)
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        checkpoint_write.export_dense(checkpoint, tmp_path, overwrite=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_write.export_dense(tmp_path / "missing", tmp_path / "x.pt")


def test_the_manifest_binds_its_embedding_snapshot(checkpoint, tmp_path):
    # Embeddings swapped in by hand (same rows, other values) would be served and evaluated
    # under this checkpoint's version: every reader refuses them, naming both versions.
    import shutil

    from serving.model import load_model

    other = make_checkpoint(tmp_path / "other", seed=3)
    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoint, mixed)
    shutil.rmtree(mixed / "embeddings")
    shutil.copytree(other / "embeddings", mixed / "embeddings")
    recorded = model_checkpoint.read_manifest(checkpoint).embedding_version
    assert recorded == checkpoint_manifest.read_manifest(checkpoint / "embeddings").version
    swapped = checkpoint_manifest.read_manifest(other / "embeddings").version
    message = (
        f"{mixed / 'embeddings'} holds embedding checkpoint {swapped}, but "
        f"{mixed / 'manifest.json'} was written with {recorded}: the embeddings were replaced "
        "after the dump"
    )
    assert checkpoint_inspect.verify(mixed)[0] == [message]
    with pytest.raises(CheckpointError) as caught:
        model_checkpoint.verify(mixed)
    assert caught.value.message == message
    with pytest.raises(CheckpointError) as caught:
        load_model(mixed, name="tiny", warm_up=False)
    assert caught.value.message == message
    with pytest.raises(CheckpointError) as caught:
        model_checkpoint.load_checkpoint(
            mixed, Tiny(), None, InProcessEmbeddingTier(CONFIG, capacity=10_000)
        )
    assert caught.value.message == message
    # A checkpoint written before the version was recorded is still read.
    raw = json.loads((mixed / "manifest.json").read_text())
    del raw["embeddings"]["version"]
    (mixed / "manifest.json").write_text(json.dumps(raw))
    assert checkpoint_inspect.verify(mixed)[0] == []


def test_train_state_is_kept_and_checked(tmp_path):
    tier = InProcessEmbeddingTier(CONFIG, capacity=100)
    state = {"epochs_done": 2, "seed": 0, "lr": 0.5, "note": "x", "streaming": False, "n": None}
    model_checkpoint.write_checkpoint(
        tmp_path / "a", Tiny(), None, tier, signature=SIGNATURE, train_state=state
    )
    assert model_checkpoint.read_manifest(tmp_path / "a").train_state == state
    for bad, needle in (
        ([1], "train_state must be a mapping"),
        ({"epoch": [1]}, "'epoch' must name a number, string, boolean or None, got [1]"),
        ({"loss": float("nan")}, "'loss' must be finite, got nan"),
    ):
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
            model_checkpoint.write_checkpoint(
                tmp_path / "b", Tiny(), None, tier, signature=SIGNATURE, train_state=bad
            )
    assert not (tmp_path / "b").exists()
    raw = json.loads((tmp_path / "a" / "manifest.json").read_text())
    raw["train_state"] = {"epochs_done": {"nested": 1}}
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"manifest\.json: train_state: 'epochs_done'"):
        model_checkpoint.read_manifest(tmp_path / "a")


# --------------------------------------------------------------------------- eval --url
def test_eval_url_splits_a_batch_over_the_servers_max_request_batch_size(
    checkpoint, tmp_path, capsys
):
    # The server answers a batch over --max-request-batch-size with 400 ("batch size N
    # exceeds this server's max batch size M"), which the scorer used to pass on: eval --url
    # with --batch-size above that limit failed. It now sends chunks of M rows.
    from clients.eval_scorers import ServerScorer
    from serving.http_app import create_app
    from serving.model import load_model
    from serving.service import PredictionService
    from tests.unit.test_client_frontends import _Uvicorn

    data = tmp_path / "rows.csv"
    write_rows(data)
    service = PredictionService(
        load_model(checkpoint, name="tiny", warm_up=False), max_request_batch_size=8
    )
    server = _Uvicorn(create_app(service))
    url = f"http://127.0.0.1:{server.port}"
    try:
        options = EvalOptions(
            data=(data,),
            out=tmp_path / "predictions.csv",
            checkpoint=checkpoint,
            url=url,
            compare=True,
            model="tiny",
            label="clicked",
            batch_size=20,
            progress=False,
        )
        result = run_eval(options)
        assert (result.rows, result.exit_code) == (40, 0)
        assert "scored 40 rows" in capsys.readouterr().out

        scorer = ServerScorer(url, "tiny")
        sent: list[int] = []
        v2 = scorer._v2

        def counting(batch):
            sent.append(batch.batch_size)
            return v2(batch)

        scorer._v2 = counting  # type: ignore[method-assign]
        batch = _tiny_batch(20)
        first = scorer.score(batch, [{}] * 20).predictions
        assert scorer.max_batch_size == 8 and sent == [20, 8, 8, 4]
        second = scorer.score(batch, [{}] * 20).predictions
        assert sent == [20, 8, 8, 4, 8, 8, 4]  # the limit learnt: no over-size request
        np.testing.assert_array_equal(first, second)
        assert first.shape == (20,)
    finally:
        server.stop()
        service.close()


def test_eval_url_alone_takes_no_output_transform_and_its_note_names_the_servers(
    checkpoint, tmp_path
):
    """With --url alone, --output-transform sigmoid used to be taken and ignored; and the
    report of a server answering logits said "logits? pass --output-transform sigmoid",
    which changed nothing. The flag is refused; the note names the server's setting."""
    from serving.http_app import create_app
    from serving.model import load_model
    from serving.service import PredictionService
    from tests.unit.test_client_frontends import _Uvicorn

    data = tmp_path / "rows.csv"
    write_rows(data, 6)
    base = {"data": (data,), "out": tmp_path / "p.csv", "model": "tiny", "progress": False}
    with pytest.raises(InvalidArgumentError) as refused:
        run_eval(EvalOptions(**base, url="http://127.0.0.1:9", output_transform="sigmoid"))
    assert refused.value.message == (
        "--output-transform sigmoid applies to in-process scoring (--checkpoint); a server's "
        "predictions come transformed by its own `recserve serve --output-transform`"
    )
    service = PredictionService(load_model(checkpoint, name="tiny", warm_up=False))
    server = _Uvicorn(create_app(service))
    try:
        options = EvalOptions(**base, url=f"http://127.0.0.1:{server.port}", label="clicked")
        result = run_eval(options, out=io.StringIO())
    finally:
        server.stop()
        service.close()
    assert result.rows == 6 and result.report["log_loss"] is None
    assert result.report["probability_note"] == (
        "predictions are not probabilities in [0, 1] (logits? start the server with "
        "`recserve serve --output-transform sigmoid`): log loss and calibration left out"
    )


def test_predict_sends_a_batch_over_the_servers_limit_in_pieces_of_its_size(
    checkpoint, tmp_path, capsys
):
    """recserve predict used to end with the server's 400 ("batch size 5 exceeds this
    server's max batch size 2") where recserve eval sends pieces of the server's size."""
    from clients import RecserveClient
    from embedding_store.cli import main
    from serving.http_app import create_app
    from serving.model import load_model
    from serving.service import PredictionService
    from tests.unit.test_client_frontends import _Uvicorn

    rows = [{"user": i, "tags": [100 + i] * (i % 3), "dense": [0.1 * i, 1.0]} for i in range(5)]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows))
    service = PredictionService(
        load_model(checkpoint, name="tiny", warm_up=False), max_request_batch_size=2
    )
    server = _Uvicorn(create_app(service))
    url = f"http://127.0.0.1:{server.port}"
    try:
        code = main(["predict", "--url", url, "--model", "tiny", "--input", str(path)])
        with RecserveClient(url, model_name="tiny") as client:
            expected = [client.predict([row]).predictions[0, 0] for row in rows]
    finally:
        server.stop()
        service.close()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and len(lines) == 5
    np.testing.assert_allclose([line["prediction"] for line in lines], expected, atol=1e-6)


def _tiny_batch(n: int) -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", np.arange(n, dtype=np.uint64)),
            IDTypeFeature.from_lists("tags", [[100 + i % 30] for i in range(n)]),
        ],
        [NonIDTypeFeature(np.zeros((n, 2), dtype=np.float32), "dense")],
        requires_grad=False,
    )


def test_eval_help_spells_out_the_default_layout(capsys):
    from embedding_store.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "separated by spaces, e.g. '71 282 62'" in text
    assert "columns NAME_0 .. NAME_{k-1}" in text


def test_diff_counts_a_row_that_became_nan_as_changed(tmp_path):
    from embedding_store.shard import EmbeddingShard

    ids = CONFIG.prefix_ids("user", np.arange(5, dtype=np.uint64))
    weights = np.arange(20, dtype=np.float32).reshape(5, 4)
    shard = EmbeddingShard(100)
    shard.replace_rows([RowBlock(ids, weights, None)])
    checkpoint_dump.dump_embeddings([shard], tmp_path / "a", CONFIG)
    # Dumps refuse NaN rows: "b" is written as a damaged file (or an older writer) holds it.
    rows = weights.copy()
    rows[3, 1] = np.nan
    (tmp_path / "b" / "shard_00000").mkdir(parents=True)
    payload = safetensors.numpy.save(
        checkpoint_dump.row_tensors(ids, rows, np.zeros((5, 0), np.float32), None),
        metadata={"format": checkpoint_manifest.FORMAT_NAME, "shard": "0", "dim": "4"},
    )
    (tmp_path / "b" / "shard_00000" / "dim_4.safetensors").write_bytes(payload)
    entry = checkpoint_manifest.FileEntry(
        shard=0,
        dim=4,
        path="shard_00000/dim_4.safetensors",
        rows=5,
        state_width=0,
        bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    checkpoint_dump.finalize_checkpoint(tmp_path / "b", CONFIG, 1, [entry], None)
    result = checkpoint_diff.diff(tmp_path / "a", tmp_path / "b", tolerance=1e30)
    (user,) = [s for s in result["embeddings"]["id_spaces"] if s["id_space"] == "user"]
    assert (user["common"], user["changed"], user["max_abs_diff"]) == (5, 1, float("inf"))
    assert not result["identical"]


# --------------------------------------------------------------------------- more tool checks
def _rows_checkpoint(directory: Path, config, rows: dict, **kwargs) -> Path:
    """A model checkpoint (no TorchScript) holding ``rows``: slot -> (raw ids, weights)."""
    tier = InProcessEmbeddingTier(config, capacity=10_000, optimizer=kwargs.pop("optimizer", None))
    for slot, (ids, weights) in rows.items():
        ids = config.prefix_ids(slot, ids) if isinstance(slot, str) else ids
        tier.shards[0].import_rows(RowBlock(ids, weights, None))
    torch.manual_seed(0)
    model = kwargs.pop("model", Tiny)()
    model_checkpoint.write_checkpoint(
        directory, model, None, tier, signature=SIGNATURE, with_jit_model=False, **kwargs
    )
    return directory


USERS = (np.arange(5, dtype=np.uint64), np.arange(20, dtype=np.float32).reshape(5, 4))


def test_a_directory_of_shard_parts_is_an_embedding_checkpoint(tmp_path):
    (tmp_path / "shard_00000").mkdir()
    assert checkpoint_common.checkpoint_kind(tmp_path) == "embedding"
    problems, summary = checkpoint_inspect.verify(tmp_path)
    assert summary["kind"] == "embedding"
    assert problems == [
        f"embedding checkpoint {tmp_path} holds shard parts but no embedding_manifest.json: "
        "parts written by several parameter servers' --dump-on-exit are not a checkpoint; "
        "take one with `recserve embedding-tier dump`"
    ]


def test_rows_of_an_id_prefix_no_slot_has_are_counted_apart(tmp_path):
    # CONFIG has two ID spaces (prefixes 1 and 2): prefix 3 is the first that none has.
    strays = (np.arange(3, dtype=np.uint64) | np.uint64(3 << 56), np.ones((3, 4), np.float32))
    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS})
    b = _rows_checkpoint(tmp_path / "b", CONFIG, {"user": USERS, 0: strays})
    embeddings = checkpoint_inspect.inspect(b)["embeddings"]
    assert embeddings["rows_per_id_space"] == {"user": 5, "(unknown prefix)": 3}
    spaces = {s["id_space"]: s for s in checkpoint_diff.diff(a, b)["embeddings"]["id_spaces"]}
    assert spaces["(unknown prefix)"]["added"] == 3 and spaces["(unknown prefix)"]["slots"] == []
    assert (spaces["user"]["common"], spaces["user"]["changed"]) == (5, 0)


def test_diff_matches_rows_by_id_space_when_the_prefixes_moved(tmp_path):
    # A slot declared first takes prefix 1: user's rows move from prefix 2 to 3, the same rows.
    wider = embedding_config_from_mapping(
        {
            "feature_index_prefix_bit": 8,
            "slots_config": {
                "age": {"dim": 4},
                "user": {"dim": 4},
                "tags": {"dim": 4},
                "item": {"dim": 4},
            },
            "feature_groups": {"content": ["tags", "item"]},
        }
    )
    assert CONFIG.index_prefix("user") != wider.index_prefix("user")
    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS})
    b = _rows_checkpoint(tmp_path / "b", wider, {"user": USERS})
    result = checkpoint_diff.diff(a, b)
    spaces = {s["id_space"]: s for s in result["embeddings"]["id_spaces"]}
    assert {k: spaces["user"][k] for k in ("common", "added", "removed", "changed")} == {
        "common": 5,
        "added": 0,
        "removed": 0,
        "changed": 0,
    }
    assert not result["embeddings"]["config_identical"] and not result["identical"]


def test_diff_counts_another_embedding_optimizer_as_a_difference(tmp_path):
    from embedding_store.optimizers import SGD

    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS}, optimizer=SGD(lr=0.1))
    b = _rows_checkpoint(tmp_path / "b", CONFIG, {"user": USERS}, optimizer=SGD(lr=0.5))
    result = checkpoint_diff.diff(a, b)
    assert all(s["changed"] == s["state_changed"] == 0 for s in result["embeddings"]["id_spaces"])
    assert not result["identical"]
    assert "  embedding optimizer: " in checkpoint_diff.format_diff(result)


def test_diff_counts_another_loss_scale_as_a_difference(tmp_path):
    scalers = []
    for scale in (512.0, 128.0):
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        scaler.scale(torch.tensor(1.0))  # the scale exists once first used
        scalers.append(scaler)
    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS}, grad_scaler=scalers[0])
    b = _rows_checkpoint(tmp_path / "b", CONFIG, {"user": USERS}, grad_scaler=scalers[1])
    result = checkpoint_diff.diff(a, b)
    assert result["dense"]["files_identical"]["scaler.pt"] is False
    assert {t["status"] for t in result["dense"]["tensors"]} == {"same"}
    assert not result["identical"]
    assert "    scaler.pt" in checkpoint_diff.format_diff(result)


def test_diff_counts_other_random_number_generator_states_as_a_difference(tmp_path):
    """rng_state.safetensors (each rank's generators) was left out of `identical`: two
    checkpoints whose resumed runs draw other random numbers (dropout) were "identical"."""
    states = [[{"cpu": torch.Generator().manual_seed(seed).get_state()}] for seed in (1, 2)]
    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS}, rng_states=states[0])
    b = _rows_checkpoint(tmp_path / "b", CONFIG, {"user": USERS}, rng_states=states[1])
    same = _rows_checkpoint(tmp_path / "same", CONFIG, {"user": USERS}, rng_states=states[0])
    none = _rows_checkpoint(tmp_path / "none", CONFIG, {"user": USERS})
    assert checkpoint_diff.diff(a, same)["identical"]
    result = checkpoint_diff.diff(a, b)
    assert result["dense"]["files_identical"] == {"dense.pt": True, "rng_state.safetensors": False}
    assert {t["status"] for t in result["dense"]["tensors"]} == {"same"}
    assert not result["identical"]
    text = checkpoint_diff.format_diff(result)
    assert "    rng_state.safetensors          differs (compared by checksum)" in text
    assert text.endswith("\n  checkpoints differ")
    assert not checkpoint_diff.diff(a, none)["identical"]  # one kept its generators, one not


class TinyPlus(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(1, 1)


def test_diff_names_dense_tensors_added_and_removed(tmp_path):
    a = _rows_checkpoint(tmp_path / "a", CONFIG, {"user": USERS})
    b = _rows_checkpoint(tmp_path / "b", CONFIG, {"user": USERS}, model=TinyPlus)
    status = {t["name"]: t["status"] for t in checkpoint_diff.diff(a, b)["dense"]["tensors"]}
    assert status == {
        "linear.weight": "same",
        "linear.bias": "same",
        "extra.weight": "added",
        "extra.bias": "added",
    }
    back = {t["name"]: t["status"] for t in checkpoint_diff.diff(b, a)["dense"]["tensors"]}
    assert back["extra.weight"] == "removed" and back["extra.bias"] == "removed"


def test_reshard_a_model_checkpoint_keeps_it_verifiable(checkpoint, tmp_path):
    out = tmp_path / "three"
    result = checkpoint_write.reshard(checkpoint, 3, out)
    assert {k: result[k] for k in ("kind", "rows", "from_shards", "shards")} == {
        "kind": "model",
        "rows": 80,
        "from_shards": 1,
        "shards": 3,
    }
    assert checkpoint_inspect.verify(out)[0] == []
    manifest = model_checkpoint.read_manifest(out)
    assert (manifest.embedding_rows, manifest.embedding_shards) == (80, 3)
    with pytest.raises(InvalidArgumentError) as refused:
        checkpoint_write.reshard(checkpoint, True, tmp_path / "bool")
    assert refused.value.message == "--shards must be an integer in 1..65536, got True"


def test_verify_reports_a_manifest_that_miscounts_its_embedding_rows(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    raw["embeddings"]["rows"] = 81
    (copy / "manifest.json").write_text(json.dumps(raw))
    problems, _summary = checkpoint_inspect.verify(copy)
    assert (
        f"{copy / 'manifest.json'} says 81 embedding rows in 1 shards, but "
        f"{copy / 'embeddings'} holds 80 rows in 1 shards"
    ) in problems


def test_verify_says_no_code_was_loaded_when_there_is_no_jit_model(tmp_path):
    plain = _rows_checkpoint(tmp_path / "plain", CONFIG, {"user": USERS})
    problems, summary = checkpoint_inspect.verify(plain, load_code=True)
    assert problems == [] and summary["jit_model"] is False and summary["code_loaded"] is False


def test_export_dense_refuses_an_existing_file_before_reading_the_checkpoint(tmp_path):
    out = tmp_path / "dense.pt"
    out.write_bytes(b"mine")
    with pytest.raises(AlreadyExistsError) as refused:
        checkpoint_write.export_dense(tmp_path / "missing", out)
    assert refused.value.message == f"{out} already exists; pass --overwrite to replace it"
    assert out.read_bytes() == b"mine"


def test_export_dense_refuses_a_target_inside_the_checkpoint(checkpoint, tmp_path):
    """With --overwrite, DIR/dense.pt used to be replaced by the TorchScript copy: the
    checkpoint then failed verification (dense.pt of another size) and no longer loaded."""
    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    for name in ("dense.pt", "jit_dense.pt", "exported.pt"):
        with pytest.raises(InvalidArgumentError) as refused:
            checkpoint_write.export_dense(copy, copy / name, overwrite=True)
        assert refused.value.message == (
            f"--out {copy / name} must not be inside the checkpoint {copy}: write the copy "
            "elsewhere"
        )
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before
    problems, _ = checkpoint_inspect.verify(copy)
    assert problems == []


def test_sizes_are_shown_in_binary_units():
    human = checkpoint_inspect._human_bytes
    assert [human(n) for n in (0, 1023, 1024, 1536, 1024**2, 5 * 1024**4, 2048 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 MiB",
        "5.0 TiB",
        "2048.0 TiB",
    ]


def test_diff_of_rows_of_other_dims_or_state_widths_counts_every_common_row(tmp_path):
    from embedding_store.optimizers import Adagrad
    from embedding_store.shard import EmbeddingShard

    wide = embedding_config_from_mapping(
        {
            "feature_index_prefix_bit": 8,
            "slots_config": {"user": {"dim": 8}, "tags": {"dim": 4}, "item": {"dim": 4}},
            "feature_groups": {"content": ["tags", "item"]},
        }
    )
    ids = CONFIG.prefix_ids("user", np.arange(5, dtype=np.uint64))
    for name, config, optimizer, dim in (
        ("plain", CONFIG, None, 4),
        ("adagrad", CONFIG, Adagrad(lr=0.1), 4),
        ("wide", wide, None, 8),
    ):
        shard = EmbeddingShard(100, optimizer=optimizer)
        shard.import_rows(RowBlock(ids, np.ones((5, dim), np.float32), None))
        checkpoint_dump.dump_embeddings([shard], tmp_path / name, config)

    def user(a, b):
        result = checkpoint_diff.diff(tmp_path / a, tmp_path / b)
        assert not result["identical"]
        (space,) = [s for s in result["embeddings"]["id_spaces"] if s["id_space"] == "user"]
        return space

    state = user("plain", "adagrad")
    assert (state["changed"], state["state_changed"]) == (0, 5)
    assert state["state_note"] == "state width 0 vs 4"
    dims = user("plain", "wide")
    assert (dims["common"], dims["changed"], dims["max_abs_diff"]) == (5, 5, None)
    assert dims["note"] == "dim 4 vs 8"


def test_diff_refuses_an_id_space_holding_rows_of_two_dims_naming_it(tmp_path):
    # Rows of no slot's prefix all land in one "(unknown prefix)" space, whatever their dim.
    prefix = np.uint64(3 << 56)
    strays = {
        0: (np.arange(3, dtype=np.uint64) | prefix, np.ones((3, 4), np.float32)),
        1: (np.arange(3, 6, dtype=np.uint64) | prefix, np.ones((3, 8), np.float32)),
    }
    mixed = _rows_checkpoint(tmp_path / "mixed", CONFIG, {"user": USERS, **strays})
    assert checkpoint_inspect.verify(mixed)[0] == []
    with pytest.raises(CheckpointError) as refused:
        checkpoint_diff.diff(mixed, mixed)
    assert re.fullmatch(
        rf"{re.escape(str(mixed / 'embeddings'))}: ID space '\(unknown prefix\)' has rows of "
        r"dims \{(4, 8|8, 4)\}",
        refused.value.message,
    )


def _rows_then_bad(path: Path, good: int, bad: int) -> None:
    lines = ["user,tags,dense_0,dense_1,clicked"]
    lines += [f"{i},100,0.5,1,{i % 2}" for i in range(good)]
    lines += ["x,,0,0,0"] * bad
    path.write_text("\n".join(lines) + "\n")


def test_bad_rows_are_listed_up_to_twenty_and_kept_up_to_a_hundred(checkpoint, tmp_path, capsys):
    """--bad-rows fail lists the first 20 bad rows of the chunk and says how many more; skip
    goes on past chunks that hold only bad rows (once rows were scored), prints 20 of them,
    and the report keeps 100 (all of them in bad_rows.txt)."""
    data = tmp_path / "rows.csv"
    base = {"data": (data,), "checkpoint": checkpoint, "progress": False, "batch_size": 200}
    _rows_then_bad(data, good=2, bad=20)
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "a.csv"))
    assert caught.value.message.count("is not an integer ID") == 20
    assert "more" not in caught.value.message
    _rows_then_bad(data, good=2, bad=105)
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(**base, out=tmp_path / "b.csv"))
    assert caught.value.message.count("is not an integer ID") == 20
    assert caught.value.message.endswith(
        f"{data}:23: column 'user': 'x' is not an integer ID\n  ... and 85 more"
    )
    # Nothing is left of the predictions files the failed runs had started.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]
    capsys.readouterr()

    base["batch_size"] = 2  # the first chunk is the good rows, every later one bad rows
    result = run_eval(EvalOptions(**base, out=tmp_path / "c.csv", bad_rows="skip", label="clicked"))
    assert (result.rows, result.skipped) == (2, 105)
    assert len(result.bad_rows) == 105 and result.report["bad_rows"] == result.bad_rows[:100]
    assert result.report["counts"]["skipped_rows"] == 105
    err = capsys.readouterr().err
    assert err.count("skipped ") == 21 and "skipped 85 more bad rows" in err
    # In-process, AUC ranks the raw model output (a float32 sigmoid may tie distinct logits).
    assert result.report["auc_note"] == "rank-based (exact), on the raw model output"


def _eval_options_of(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[int, EvalOptions]:
    """The exit code of ``recserve eval ARGV`` and the EvalOptions its flags became (run_eval
    replaced by a stub answering exit code 3)."""
    from clients import eval as eval_module
    from clients.eval import EvalResult
    from embedding_store.cli import build_parser

    seen: list[EvalOptions] = []

    def fake_run_eval(options: EvalOptions) -> EvalResult:
        seen.append(options)
        return EvalResult(rows=0, skipped=0, report={}, exit_code=3)

    monkeypatch.setattr(eval_module, "run_eval", fake_run_eval)
    args = build_parser().parse_args(["eval", *argv])
    code = args.handler(args)
    assert len(seen) == 1
    return code, seen[0]


def test_eval_flags_reach_eval_options_and_its_exit_code_is_run_evals(monkeypatch):
    """Every `recserve eval` flag lands in the EvalOptions field of its name; the command
    exits with run_eval's exit code (3: --compare found differences)."""
    code, options = _eval_options_of(
        monkeypatch,
        ["--data", "a.csv", "b.parquet", "--out", "o.csv", "--checkpoint", "ck", "--url",
         "http://127.0.0.1:9", "--compare", "--mapping", "m.yml", "--no-label", "--report",
         "rep", "--batch-size", "7", "--bad-rows", "skip", "--model", "m2",
         "--output-transform", "sigmoid", "--protocol", "friendly", "--tolerance", "0.5",
         "--calibration-bins", "4", "--timeout", "2.5", "--overwrite", "--quiet"],
    )  # fmt: skip
    assert code == 3
    assert options == EvalOptions(
        data=(Path("a.csv"), Path("b.parquet")),
        out=Path("o.csv"),
        checkpoint=Path("ck"),
        url="http://127.0.0.1:9",
        compare=True,
        mapping=Path("m.yml"),
        label=None,
        no_label=True,
        report=Path("rep"),
        batch_size=7,
        bad_rows="skip",
        model="m2",
        output_transform="sigmoid",
        protocol="friendly",
        tolerance=0.5,
        overwrite=True,
        timeout=2.5,
        calibration_bins=4,
        progress=False,
    )
    _, options = _eval_options_of(
        monkeypatch, ["--data", "a.csv", "--out", "o.csv", "--label", "y"]
    )
    assert options == EvalOptions(data=(Path("a.csv"),), out=Path("o.csv"), label="y")
    # --compare with an exact match: a tolerance of 0 is allowed.
    _, options = _eval_options_of(
        monkeypatch, ["--data", "a.csv", "--out", "o.csv", "--tolerance", "0"]
    )
    assert options.tolerance == 0.0


def test_checkpoint_verify_exits_1_when_any_checkpoint_fails_and_json_lists_several(
    checkpoint, tmp_path, capsys
):
    """`recserve checkpoint verify` exits 1 when one of its checkpoints fails; --json prints
    one object for one checkpoint, a list of them for several."""
    from embedding_store.cli import main as cli_main

    missing = tmp_path / "nowhere"
    assert cli_main(["checkpoint", "verify", str(checkpoint)]) == 0
    capsys.readouterr()
    assert cli_main(["checkpoint", "verify", str(checkpoint), str(missing)]) == 1
    assert f"FAILED: checkpoint {missing}: 1 problem(s)" in capsys.readouterr().err
    assert cli_main(["checkpoint", "verify", "--json", str(missing)]) == 1
    single = json.loads(capsys.readouterr().out)
    assert (single["ok"], single["problems"]) == (
        False,
        [f"checkpoint {missing} does not exist or is not a directory"],
    )
    assert cli_main(["checkpoint", "verify", "--json", str(checkpoint), str(missing)]) == 1
    several = json.loads(capsys.readouterr().out)
    assert [report["ok"] for report in several] == [True, False]


def test_inspect_of_an_embedding_checkpoint_prints_its_damaged_files(tmp_path):
    # A bare embedding checkpoint kept its unreadable files in info["embeddings"]["problems"]
    # only, which format_inspect never printed: the text showed 0 rows in every ID space and
    # no PROBLEM line, as for an intact checkpoint of empty spaces.
    embeddings = _rows_checkpoint(tmp_path / "model", CONFIG, {"user": USERS}) / "embeddings"
    part = embeddings / "shard_00000" / "dim_4.safetensors"
    part.write_bytes(b"not safetensors")
    info = checkpoint_inspect.inspect(embeddings)
    assert info["kind"] == "embedding" and info["embeddings"]["rows_per_id_space"] == {}
    assert len(info["problems"]) == 1
    assert info["problems"][0].startswith("shard_00000/dim_4.safetensors: ")
    lines = checkpoint_inspect.format_inspect(info).splitlines()
    assert [line for line in lines if "PROBLEM" in line] == [f"  PROBLEM: {info['problems'][0]}"]
