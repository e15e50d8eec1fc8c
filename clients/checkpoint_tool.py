"""``recserve checkpoint inspect|verify|reshard|diff|export-dense``: offline checkpoint tools.

They work on the files alone (no server, no training code), and never run a checkpoint's
TorchScript (``jit_dense.pt`` is code) unless asked (``load_code``): a *model checkpoint*
(``manifest.json``, dense files, ``embeddings/``, ``DONE``; :mod:`embedding_store.model_checkpoint`)
or a bare *embedding checkpoint* (``embedding_manifest.json``, per-shard safetensors, ``DONE``;
:mod:`embedding_store.checkpoint`).

Writers (``reshard``, ``export-dense``) refuse an existing target unless ``overwrite``, and write
under a temporary name next to it that is renamed into place only when complete, so no reader
ever sees a partial checkpoint or file. Everything read is checked against the manifests'
sizes and SHA-256 checksums first.

``diff`` and ``reshard`` read embedding rows into memory (``reshard`` one target shard at a
time, ``diff`` everything of both checkpoints): plan memory for tables of that size.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from clients import eval_report
from embedding_store import checkpoint as embedding_checkpoint
from embedding_store import model_checkpoint
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import (
    AlreadyExistsError,
    CheckpointError,
    InvalidArgumentError,
    RecserveError,
)

__all__ = [
    "checkpoint_kind",
    "diff",
    "export_dense",
    "format_diff",
    "format_inspect",
    "inspect",
    "reshard",
    "verify",
]

MODEL = "model"
EMBEDDING = "embedding"
ALL_SPACES = "(all slots)"


# --------------------------------------------------------------------------- helpers
def checkpoint_kind(directory: str | os.PathLike[str]) -> str:
    """``"model"`` or ``"embedding"``; CheckpointError when it is neither."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist or is not a directory")
    if (root / model_checkpoint.MANIFEST_NAME).exists():
        return MODEL
    if (root / embedding_checkpoint.MANIFEST_NAME).exists():
        return EMBEDDING
    if any(root.glob("shard_*")):
        return EMBEDDING  # shard parts: the embedding reader says what they are
    if not (root / model_checkpoint.DONE_MARKER).exists():
        raise CheckpointError(
            f"checkpoint {root} is incomplete: no {model_checkpoint.DONE_MARKER} marker and no "
            "manifest (the write did not finish)"
        )
    raise CheckpointError(
        f"{root} has neither {model_checkpoint.MANIFEST_NAME} (model checkpoint) nor "
        f"{embedding_checkpoint.MANIFEST_NAME} (embedding checkpoint)"
    )


def _embedding_dir(directory: Path, kind: str) -> Path:
    return directory / model_checkpoint.EMBEDDINGS_DIR if kind == MODEL else directory


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _size_on_disk(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # removed while walking
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _read_entry(
    manifest: embedding_checkpoint.EmbeddingManifest, entry: embedding_checkpoint.FileEntry
) -> dict[str, np.ndarray]:
    # embedding_store.checkpoint's own reader: size, SHA-256, safetensors and shapes checked.
    return embedding_checkpoint._read_verified(manifest, entry)


def _space_names(config: EmbeddingConfig, ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(ID-space index of each ID, the space names) from the config's ID prefixes."""
    bit = config.feature_index_prefix_bit
    if bit == 0:
        return np.zeros(len(ids), dtype=np.int64), [ALL_SPACES]
    prefix = (ids >> np.uint64(64 - bit)).astype(np.int64) - 1
    names = list(config.id_spaces)
    unknown = (prefix < 0) | (prefix >= len(names))
    if unknown.any():
        prefix = np.where(unknown, len(names), prefix)
        names.append("(unknown prefix)")
    return prefix, names


def _slots_of(config: EmbeddingConfig) -> dict[str, list[str]]:
    spaces: dict[str, list[str]] = {}
    for name in config.slot_names:
        key = config.id_space_of(name) if config.feature_index_prefix_bit else ALL_SPACES
        spaces.setdefault(key, []).append(name)
    return spaces


def _forward_signature(module: Any) -> str | None:
    try:
        return str(module.forward.schema)
    except Exception:  # an unusual TorchScript module: the schema is informational only
        return None


# --------------------------------------------------------------------------- inspect
def _inspect_embeddings(directory: Path) -> dict[str, Any]:
    manifest = embedding_checkpoint.read_manifest(directory)
    config = manifest.embedding_config
    rows_per_space: dict[str, int] = {}
    problems = []
    for entry in manifest.files:
        try:
            from safetensors import safe_open

            with safe_open(str(directory / entry.path), framework="numpy") as handle:
                ids = handle.get_tensor("ids")
        except Exception as error:  # corrupt files are verify's business; inspect reports
            problems.append(f"{entry.path}: {error}")
            continue
        index, names = _space_names(config, np.asarray(ids, dtype=np.uint64))
        counts = np.bincount(index, minlength=len(names))
        for name, count in zip(names, counts.tolist()):
            if count:
                rows_per_space[name] = rows_per_space.get(name, 0) + count
    slots = []
    for name in config.slot_names:
        slot = config.slots_config[name]
        space = config.id_space_of(name) if config.feature_index_prefix_bit else ALL_SPACES
        slots.append(
            {
                "name": name,
                "dim": slot.dim,
                "id_space": space,
                "prefix": f"0x{config.index_prefix(name):016x}",
                "embedding_summation": slot.embedding_summation,
                "sqrt_scaling": slot.sqrt_scaling,
            }
        )
    return {
        "directory": str(directory),
        "version": manifest.version,
        "format_version": manifest.format_version,
        "created_at": _iso(manifest.created_unix),
        "num_shards": manifest.num_shards,
        "rows": manifest.total_rows,
        "rows_per_shard": manifest.rows_per_shard(),
        "rows_per_id_space": rows_per_space,
        "files": [
            {"path": e.path, "shard": e.shard, "dim": e.dim, "rows": e.rows, "bytes": e.bytes}
            for e in manifest.files
        ],
        "optimizer": manifest.optimizer,
        "feature_index_prefix_bit": config.feature_index_prefix_bit,
        "feature_groups": {k: list(v) for k, v in config.feature_groups.items()},
        "slots": slots,
        "problems": problems,
    }


def inspect(directory: str | os.PathLike[str], *, load_code: bool = False) -> dict[str, Any]:
    """What a checkpoint holds (manifests, shapes and the dense model's signatures)."""
    root = Path(directory)
    kind = checkpoint_kind(root)
    info: dict[str, Any] = {"path": str(root), "kind": kind, "size_bytes": _size_on_disk(root)}
    if kind == EMBEDDING:
        info["embeddings"] = _inspect_embeddings(root)
        info["created_at"] = info["embeddings"]["created_at"]
        return info
    manifest = model_checkpoint.read_manifest(root)
    info.update(
        version=manifest.version,
        step=manifest.step,
        created_at=_iso(manifest.created_unix),
        created_unix=manifest.created_unix,
        model_class=manifest.model_class,
        train_state=manifest.train_state,
        dense_files={name: dict(meta) for name, meta in manifest.files.items()},
        feature_signature=manifest.signature.to_dict() if manifest.signature else None,
    )
    problems: list[str] = []
    forward = None
    if manifest.has_jit_model and load_code:
        try:
            forward = _forward_signature(model_checkpoint.load_jit_model(manifest))
        except RecserveError as error:
            problems.append(error.message)
    info["forward_signature"] = forward
    info["jit_model"] = manifest.has_jit_model
    info["code_loaded"] = manifest.has_jit_model and load_code
    parameters: dict[str, list[int]] = {}
    try:
        state = model_checkpoint.load_state(manifest, model_checkpoint.DENSE_FILE)
        parameters = {k: list(v.shape) for k, v in state.items() if hasattr(v, "shape")}
    except RecserveError as error:
        problems.append(error.message)
    info["dense_parameters"] = parameters
    info["dense_parameter_count"] = int(sum(int(np.prod(s)) for s in parameters.values()))
    try:
        info["embeddings"] = _inspect_embeddings(manifest.embeddings_directory)
        problems += info["embeddings"]["problems"]
    except RecserveError as error:
        info["embeddings"] = None
        problems.append(error.message)
    info["problems"] = problems
    return info


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def format_inspect(info: dict[str, Any]) -> str:
    lines = [f"checkpoint {info['path']} ({info['kind']} checkpoint)"]
    if info["kind"] == MODEL:
        lines += [
            f"  version        {info['version']}",
            f"  step           {info['step']}",
            f"  created        {info['created_at']}",
            f"  model class    {info['model_class']}",
            "  train state    "
            + (", ".join(f"{k} {v}" for k, v in info["train_state"].items()) or "(none)"),
        ]
    lines.append(
        f"  size on disk   {_human_bytes(info['size_bytes'])} ({info['size_bytes']} bytes)"
    )
    if info["kind"] == MODEL:
        lines.append("  dense files")
        for name, meta in info["dense_files"].items():
            lines.append(f"    {name:<14} {meta['bytes']:>12} bytes  sha256 {meta['sha256'][:16]}…")
        lines.append(
            f"  dense model    {info['dense_parameter_count']} parameters in "
            f"{len(info['dense_parameters'])} tensors"
        )
        for name, shape in info["dense_parameters"].items():
            lines.append(f"    {name:<30} {shape}")
        if not info.get("jit_model", True):
            forward = "n/a (no jit_dense.pt)"
        elif not info.get("code_loaded", True):
            forward = f"not loaded: jit_dense.pt is code ({LOAD_CODE_HINT})"
        else:
            forward = info["forward_signature"] or "n/a"
        lines.append(f"  forward        {forward}")
        signature = info["feature_signature"]
        if signature:
            ids = ", ".join(
                f["name"] + ("" if f["single_id"] else "[]") for f in signature["id_features"]
            )
            dense = ", ".join(
                f"{f['name']} {f['dtype']}{f['sample_shape']}" for f in signature["non_id_features"]
            )
            lines.append(f"  ID features    {ids}")
            lines.append(f"  non-ID         {dense or '(none)'}")
            lines.append(f"  labels         {', '.join(signature['label_names']) or '(none)'}")
        else:
            lines.append("  feature signature: none recorded")
    emb = info.get("embeddings")
    if emb:
        optimizer = (emb["optimizer"] or {}).get("name", "none")
        lines += [
            f"  embeddings     {emb['rows']} rows in {emb['num_shards']} shard(s), "
            f"created {emb['created_at']}, optimizer {optimizer}",
            f"  embedding version {emb['version']} (what the shards that load it report)",
            "  rows per shard " + ", ".join(str(r) for r in emb["rows_per_shard"]),
            f"  prefix bits    {emb['feature_index_prefix_bit']}",
            "  slots (name, dim, ID space, rows in the space)",
        ]
        for slot in emb["slots"]:
            rows = emb["rows_per_id_space"].get(slot["id_space"], 0)
            lines.append(
                f"    {slot['name']:<24} dim {slot['dim']:<4} {slot['id_space']:<24} {rows}"
            )
    for problem in info.get("problems") or ():
        lines.append(f"  PROBLEM: {problem}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- verify
#: How the tools say that loading ``jit_dense.pt`` is asked for.
LOAD_CODE_HINT = "--load-code loads it, running code from the checkpoint: trusted ones only"


def verify(
    directory: str | os.PathLike[str], *, load_code: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Check everything; returns (problems, summary). No exception for a bad checkpoint:
    every problem found is listed (a missing manifest or marker stops the check early).

    ``jit_dense.pt`` is TorchScript, which runs code of the checkpoint's author when loaded
    (its ``__setstate__``): it is checked against its size and checksum only, and loaded
    only with ``load_code`` (a checkpoint you trust: your own, before serving it)."""
    root = Path(directory)
    problems: list[str] = []
    summary: dict[str, Any] = {"path": str(root)}
    try:
        kind = checkpoint_kind(root)
    except RecserveError as error:
        return [error.message], summary
    summary["kind"] = kind
    if kind == MODEL:
        try:
            manifest = model_checkpoint.read_manifest(root)
        except RecserveError as error:
            return [error.message], summary
        summary.update(version=manifest.version, dense_files=len(manifest.files))
        for name in manifest.files:
            try:
                model_checkpoint.read_verified_file(manifest, name)
            except RecserveError as error:
                problems.append(error.message)
                continue
            try:
                if name != model_checkpoint.JIT_FILE:
                    model_checkpoint.load_state(manifest, name)  # tensors only, no code
                elif load_code:
                    model_checkpoint.load_jit_model(manifest)
            except RecserveError as error:
                problems.append(error.message)
        summary["jit_model"] = manifest.has_jit_model
        summary["code_loaded"] = load_code and manifest.has_jit_model
        expected_rows, expected_shards = manifest.embedding_rows, manifest.embedding_shards
    embedding_dir = _embedding_dir(root, kind)
    try:
        emb = embedding_checkpoint.read_manifest(embedding_dir)
    except RecserveError as error:
        problems.append(error.message)
        return problems, summary
    summary.update(embedding_files=len(emb.files), rows=emb.total_rows, shards=emb.num_shards)
    for entry in emb.files:
        try:
            _read_entry(emb, entry)
        except RecserveError as error:
            problems.append(error.message)
    if kind == MODEL and (emb.total_rows, emb.num_shards) != (expected_rows, expected_shards):
        problems.append(
            f"{root / model_checkpoint.MANIFEST_NAME} says {expected_rows} embedding rows in "
            f"{expected_shards} shards, but {embedding_dir} holds {emb.total_rows} rows in "
            f"{emb.num_shards} shards"
        )
    if kind == MODEL:
        try:
            model_checkpoint.check_embeddings_match(manifest, emb)
        except RecserveError as error:
            problems.append(error.message)
    return problems, summary


def require_verified(directory: str | os.PathLike[str]) -> dict[str, Any]:
    problems, summary = verify(directory)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} failed verification:\n  - " + "\n  - ".join(problems)
        )
    return summary


# --------------------------------------------------------------------------- reshard
def _write_resharded_embeddings(
    source: embedding_checkpoint.EmbeddingManifest, target: Path, shards: int
) -> embedding_checkpoint.EmbeddingManifest:
    """Write ``source``'s rows as ``shards`` shards into directory ``target`` (which exists)."""
    saved_optimizer = embedding_checkpoint.optimizer_of(source)  # its state is kept as saved
    entries = []
    for shard in range(shards):
        blocks = embedding_checkpoint.read_rows_for_replica(
            source, shard, shards, keep_state_of=saved_optimizer
        )
        part = target / f"shard_{shard:05d}"
        part.mkdir(parents=True, exist_ok=True)
        for block in blocks:
            n = len(block.ids)
            if n == 0:
                continue
            state = block.state if block.state is not None else np.zeros((n, 0), np.float32)
            payload = safetensors.numpy.save(
                {
                    "ids": np.ascontiguousarray(block.ids, dtype=np.uint64),
                    "weights": np.ascontiguousarray(block.weights, dtype=np.float32),
                    "state": np.ascontiguousarray(state, dtype=np.float32),
                },
                metadata={
                    "format": embedding_checkpoint.FORMAT_NAME,
                    "shard": str(shard),
                    "dim": str(block.dim),
                },
            )
            relative = f"{part.name}/dim_{block.dim}.safetensors"
            embedding_checkpoint._write_atomic(target / relative, payload)
            entries.append(
                embedding_checkpoint.FileEntry(
                    shard=shard,
                    dim=block.dim,
                    path=relative,
                    rows=n,
                    state_width=int(state.shape[1]),
                    bytes=len(payload),
                    sha256=hashlib.sha256(payload).hexdigest(),
                )
            )
    embedding_checkpoint.finalize_checkpoint(
        target,
        source.embedding_config,
        shards,
        entries,
        source.optimizer,
        version=source.version,  # the same rows, sharded otherwise
    )
    return embedding_checkpoint.read_manifest(target)


def reshard(
    directory: str | os.PathLike[str],
    shards: int,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Rewrite the embedding part with ``shards`` shards into ``out`` (dense files copied,
    same version); the source is verified first and ``out`` appears complete or not at all."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidArgumentError(f"--shards must be an integer >= 1, got {shards!r}")
    root, target = Path(directory), Path(out).resolve()
    if target == root.resolve() or root.resolve() in target.parents:
        raise InvalidArgumentError(f"--out {out} must not be {directory} or inside it")
    embedding_checkpoint.check_target(target, overwrite=overwrite)
    summary = require_verified(root)
    kind = summary["kind"]
    source = embedding_checkpoint.read_manifest(_embedding_dir(root, kind))
    staging = embedding_checkpoint.staging_directory_for(target)
    try:
        if kind == EMBEDDING:
            written = _write_resharded_embeddings(source, staging, shards)
        else:
            manifest = model_checkpoint.read_manifest(root)
            (staging / model_checkpoint.EMBEDDINGS_DIR).mkdir()
            written = _write_resharded_embeddings(
                source, staging / model_checkpoint.EMBEDDINGS_DIR, shards
            )
            for name in manifest.files:
                payload = model_checkpoint.read_verified_file(manifest, name)
                embedding_checkpoint._write_atomic(staging / name, payload)
            raw = json.loads((root / model_checkpoint.MANIFEST_NAME).read_text())
            raw["embeddings"] = {
                **raw.get("embeddings", {}),
                "rows": written.total_rows,
                "shards": written.num_shards,
            }
            raw["resharded"] = {"from_shards": source.num_shards, "at": _iso(time.time())}
            embedding_checkpoint._write_atomic(
                staging / model_checkpoint.MANIFEST_NAME, json.dumps(raw, indent=2).encode()
            )
            embedding_checkpoint._write_atomic(staging / model_checkpoint.DONE_MARKER, b"")
        if written.total_rows != source.total_rows:
            raise CheckpointError(
                f"resharding lost rows: {source.total_rows} in, {written.total_rows} out"
            )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    embedding_checkpoint.publish_directory(staging, target, overwrite=overwrite)
    return {
        "path": str(target),
        "kind": kind,
        "version": summary.get("version"),
        "rows": written.total_rows,
        "from_shards": source.num_shards,
        "shards": shards,
        "rows_per_shard": written.rows_per_shard(),
    }


# --------------------------------------------------------------------------- diff
def _rows_by_space(
    manifest: embedding_checkpoint.EmbeddingManifest,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """ID space -> (masked IDs sorted, weights and optimizer state in that order), every
    file verified."""
    config = manifest.embedding_config
    mask = np.uint64(config.id_mask)
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for entry in manifest.files:
        tensors = _read_entry(manifest, entry)
        ids, weights, state = tensors["ids"], tensors["weights"], tensors["state"]
        index, names = _space_names(config, ids)
        for i, name in enumerate(names):
            picked = np.flatnonzero(index == i)
            if picked.size:
                parts.setdefault(name, []).append(
                    (ids[picked] & mask, weights[picked], state[picked])
                )
    out = {}
    for name, chunks in parts.items():
        ids = np.concatenate([c[0] for c in chunks])
        dims = {c[1].shape[1] for c in chunks}
        if len(dims) > 1:
            raise CheckpointError(
                f"{manifest.directory}: ID space {name!r} has rows of dims {dims}"
            )
        weights = np.concatenate([c[1] for c in chunks])
        state = np.concatenate([c[2] for c in chunks])
        order = np.argsort(ids, kind="stable")
        out[name] = (ids[order], weights[order], state[order])
    return out


def _rows_differing(a: np.ndarray, b: np.ndarray, tolerance: float) -> tuple[int, float]:
    """(rows of ``a`` and ``b`` (float32 [n, w] each) that differ by more than ``tolerance``
    in some column, the largest difference); NaN counts as an infinite difference."""
    if a.shape[1] == 0:
        return 0, 0.0
    delta = np.abs(a.astype(np.float64) - b.astype(np.float64))
    per_row = np.where(np.isnan(delta), np.inf, delta).max(axis=1)
    return int((per_row > tolerance).sum()), float(per_row.max())


def _diff_embeddings(a: Path, b: Path, tolerance: float) -> dict[str, Any]:
    ma, mb = embedding_checkpoint.read_manifest(a), embedding_checkpoint.read_manifest(b)
    ra, rb = _rows_by_space(ma), _rows_by_space(mb)
    slots = _slots_of(ma.embedding_config)
    for space, names in _slots_of(mb.embedding_config).items():
        slots.setdefault(space, names)
    spaces = []
    for name in [*slots, *sorted((set(ra) | set(rb)) - set(slots))]:
        ids_a, w_a, st_a = ra.get(name, (np.zeros(0, np.uint64), None, None))
        ids_b, w_b, st_b = rb.get(name, (np.zeros(0, np.uint64), None, None))
        common, ia, ib = np.intersect1d(ids_a, ids_b, assume_unique=True, return_indices=True)
        entry: dict[str, Any] = {
            "id_space": name,
            "slots": slots.get(name, []),
            "rows_a": int(ids_a.size),
            "rows_b": int(ids_b.size),
            "added": int(ids_b.size - common.size),
            "removed": int(ids_a.size - common.size),
            "common": int(common.size),
            "changed": 0,
            "max_abs_diff": 0.0,
            # Optimizer state (Adam moments and step counts, Adagrad accumulators): rows
            # with the same weights resume differently when it differs.
            "state_changed": 0,
        }
        if common.size:
            if w_a.shape[1] != w_b.shape[1]:
                entry.update(changed=int(common.size), max_abs_diff=None)
                entry["note"] = f"dim {w_a.shape[1]} vs {w_b.shape[1]}"
            else:
                changed, worst = _rows_differing(w_a[ia], w_b[ib], tolerance)
                entry.update(changed=changed, max_abs_diff=worst)
            if st_a.shape[1] != st_b.shape[1]:
                entry["state_changed"] = int(common.size)
                entry["state_note"] = f"state width {st_a.shape[1]} vs {st_b.shape[1]}"
            else:
                entry["state_changed"] = _rows_differing(st_a[ia], st_b[ib], tolerance)[0]
        spaces.append(entry)
    config_same = ma.embedding_config == mb.embedding_config
    return {
        "optimizer": [ma.optimizer, mb.optimizer],
        "config_identical": config_same,
        "shards": [ma.num_shards, mb.num_shards],
        "rows": [ma.total_rows, mb.total_rows],
        "id_spaces": spaces,
    }


def _diff_dense(a: Path, b: Path) -> dict[str, Any]:
    ma, mb = model_checkpoint.read_manifest(a), model_checkpoint.read_manifest(b)
    sa = model_checkpoint.load_state(ma, model_checkpoint.DENSE_FILE)
    sb = model_checkpoint.load_state(mb, model_checkpoint.DENSE_FILE)
    tensors = []
    for name in [*sa, *(k for k in sb if k not in sa)]:
        x, y = sa.get(name), sb.get(name)
        entry: dict[str, Any] = {"name": name}
        if x is None or y is None:
            entry["status"] = "added" if x is None else "removed"
        elif tuple(x.shape) != tuple(y.shape):
            entry.update(status="shape changed", shape_a=list(x.shape), shape_b=list(y.shape))
        else:
            delta = (x.double() - y.double()).abs()
            worst = float(delta.max()) if delta.numel() else 0.0
            entry.update(status="same" if worst == 0 else "changed", max_abs_diff=worst)
        tensors.append(entry)
    files = {
        name: (ma.files.get(name, {}).get("sha256") == mb.files.get(name, {}).get("sha256"))
        for name in sorted(set(ma.files) | set(mb.files))
    }
    return {
        "versions": [ma.version, mb.version],
        "steps": [ma.step, mb.step],
        "signature_identical": ma.signature == mb.signature,
        "tensors": tensors,
        "files_identical": files,
        "max_abs_diff": max((t.get("max_abs_diff") or 0.0 for t in tensors), default=0.0),
    }


#: Dense files a diff compares by checksum (besides dense.pt's tensors, compared by value).
_CHECKSUMMED = (
    model_checkpoint.JIT_FILE,
    model_checkpoint.OPTIMIZER_FILE,
    model_checkpoint.SCALER_FILE,
)


def diff(
    directory_a: str | os.PathLike[str],
    directory_b: str | os.PathLike[str],
    *,
    tolerance: float = 0.0,
) -> dict[str, Any]:
    """Per ID space (slot or feature group) rows added/removed/changed and the max abs
    difference of common rows; per dense tensor the max abs difference. Both verified first.

    ``identical`` is True only when nothing differs: rows, optimizer state and the embedding
    config (and its optimizer); for model checkpoints also the dense tensors, the feature
    signature, and by checksum ``jit_dense.pt`` (the TorchScript code serving runs, which can
    change while ``dense.pt`` does not), ``opt.pt`` and ``scaler.pt``."""
    a, b = Path(directory_a), Path(directory_b)
    kind_a, kind_b = require_verified(a)["kind"], require_verified(b)["kind"]
    if kind_a != kind_b:
        raise InvalidArgumentError(f"{a} is a {kind_a} checkpoint but {b} is a {kind_b} one")
    result: dict[str, Any] = {"a": str(a), "b": str(b), "kind": kind_a, "tolerance": tolerance}
    result["embeddings"] = _diff_embeddings(
        _embedding_dir(a, kind_a), _embedding_dir(b, kind_b), tolerance
    )
    result["dense"] = _diff_dense(a, b) if kind_a == MODEL else None
    emb = result["embeddings"]["id_spaces"]
    dense = result["dense"]
    result["identical"] = (
        all(
            s["added"] == 0 and s["removed"] == 0 and s["changed"] == 0 and s["state_changed"] == 0
            for s in emb
        )
        and result["embeddings"]["optimizer"][0] == result["embeddings"]["optimizer"][1]
        and result["embeddings"]["config_identical"]
        and (
            dense is None
            or (
                all(t["status"] == "same" for t in dense["tensors"])
                and dense["signature_identical"]
                # The TorchScript code, the dense optimizer's state and the loss scale:
                # compared by checksum.
                and all(dense["files_identical"].get(name, True) for name in _CHECKSUMMED)
            )
        )
    )
    return result


def format_diff(result: dict[str, Any]) -> str:
    emb = result["embeddings"]
    lines = [
        f"diff {result['a']} -> {result['b']} ({result['kind']} checkpoints)",
        f"  embeddings: {emb['rows'][0]} -> {emb['rows'][1]} rows, shards {emb['shards'][0]} "
        f"-> {emb['shards'][1]}, config {'identical' if emb['config_identical'] else 'DIFFERS'}",
        f"  {'ID space':<24} {'rows a':>8} {'rows b':>8} {'added':>7} {'removed':>7} "
        f"{'changed':>7} {'max abs diff':>13} {'state changed':>13}  slots",
    ]
    for s in emb["id_spaces"]:
        worst = "n/a" if s["max_abs_diff"] is None else f"{s['max_abs_diff']:.6g}"
        lines.append(
            f"  {s['id_space']:<24} {s['rows_a']:>8} {s['rows_b']:>8} {s['added']:>7} "
            f"{s['removed']:>7} {s['changed']:>7} {worst:>13} {s['state_changed']:>13}  "
            f"{', '.join(s['slots'])}"
        )
    optimizers = emb["optimizer"]
    if optimizers[0] != optimizers[1]:
        lines.append(f"  embedding optimizer: {optimizers[0]} -> {optimizers[1]}")
    dense = result["dense"]
    if dense is not None:
        lines.append(
            f"  dense: versions {dense['versions'][0]} -> {dense['versions'][1]}, signature "
            f"{'identical' if dense['signature_identical'] else 'DIFFERS'}, max abs diff "
            f"{dense['max_abs_diff']:.6g}"
        )
        for t in dense["tensors"]:
            detail = f"max abs diff {t['max_abs_diff']:.6g}" if "max_abs_diff" in t else t["status"]
            lines.append(f"    {t['name']:<30} {t['status']:<14} {detail}")
        for name in _CHECKSUMMED:
            if not dense["files_identical"].get(name, True):
                lines.append(f"    {name:<30} differs (compared by checksum)")
    lines.append("  identical" if result["identical"] else "  checkpoints differ")
    return "\n".join(lines)


# --------------------------------------------------------------------------- export-dense
def export_dense(
    directory: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
) -> dict[str, Any]:
    """Copy ``jit_dense.pt`` (verified against the manifest and loadable) to ``out``."""
    target = Path(out)
    if target.exists() and not overwrite:
        raise AlreadyExistsError(f"{target} already exists; pass --overwrite to replace it")
    if target.is_dir():
        raise InvalidArgumentError(f"--out {target} is a directory; give a file name")
    manifest = model_checkpoint.read_manifest(directory)
    if not manifest.has_jit_model:
        raise CheckpointError(
            f"checkpoint {manifest.directory} has no {model_checkpoint.JIT_FILE} "
            "(dumped with with_jit_model=False)"
        )
    payload = model_checkpoint.read_verified_file(manifest, model_checkpoint.JIT_FILE)
    module = model_checkpoint.load_jit_model(manifest)
    digest = hashlib.sha256(payload).hexdigest()
    with eval_report.atomic_file(target, overwrite=overwrite) as temporary:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        written = temporary.read_bytes()
        if hashlib.sha256(written).hexdigest() != digest:
            raise CheckpointError(f"{target}: the written copy does not match its checksum")
        _check_loadable(written, target)
    return {
        "path": str(target),
        "bytes": len(payload),
        "sha256": digest,
        "version": manifest.version,
        "forward_signature": _forward_signature(module),
    }


def _check_loadable(payload: bytes, target: Path) -> None:
    import torch

    try:
        model_checkpoint._quiet_jit(torch.jit.load, io.BytesIO(payload), map_location="cpu")
    except Exception as error:
        raise CheckpointError(f"{target}: the copy is not loadable TorchScript: {error}") from None


def iter_problems(problems: Iterable[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)
