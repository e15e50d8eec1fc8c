"""``recserve checkpoint inspect|verify``: what a checkpoint holds, and whether it is intact.

Both work on the files alone (no server, no training code), and never run a checkpoint's
TorchScript (``jit_dense.pt`` is code) unless asked (``load_code``). ``verify`` checks
everything against the manifests' sizes and SHA-256 checksums; ``require_verified`` is what the
other tools (``reshard``, ``diff``) run first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from clients.checkpoint_common import (
    ALL_SPACES,
    EMBEDDING,
    MODEL,
    checkpoint_kind,
    embedding_dir_of,
    forward_signature,
    iso,
    read_entry,
    space_names,
)
from embedding_store import checkpoint_manifest, model_checkpoint
from embedding_store.errors import CheckpointError, RecserveError

__all__ = ["format_inspect", "inspect", "iter_problems", "require_verified", "verify"]


# --------------------------------------------------------------------------- inspect
def _size_on_disk(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # removed while walking
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _inspect_embeddings(directory: Path) -> dict[str, Any]:
    manifest = checkpoint_manifest.read_manifest(directory)
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
        index, names = space_names(config, np.asarray(ids, dtype=np.uint64))
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
        "created_at": iso(manifest.created_unix),
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


def inspect(
    directory: str | os.PathLike[str], *, load_code: bool = False, verify_all: bool = False
) -> dict[str, Any]:
    """What a checkpoint holds (manifests, shapes and the dense model's signatures).

    ``info["problems"]`` lists what it met on the way (a dense file that does not load, one
    holding NaN); it reads only the embedding files' IDs. ``verify_all``: also run
    :func:`verify` (every file read and checked: sizes, checksums, shapes, finiteness,
    signature against embedding config) and add its problems (``info["verified"]``)."""
    info = _inspect(directory, load_code=load_code)
    if verify_all:
        problems, _summary = verify(directory, load_code=load_code)
        # Both read the dense files: a problem met by both is listed once.
        info["problems"] = list(dict.fromkeys([*info["problems"], *problems]))
        info["verified"] = True
    return info


def _inspect(directory: str | os.PathLike[str], *, load_code: bool) -> dict[str, Any]:
    root = Path(directory)
    kind = checkpoint_kind(root)
    info: dict[str, Any] = {"path": str(root), "kind": kind, "size_bytes": _size_on_disk(root)}
    if kind == EMBEDDING:
        info["embeddings"] = _inspect_embeddings(root)
        info["created_at"] = info["embeddings"]["created_at"]
        # At the top, as for a model checkpoint: format_inspect prints these.
        info["problems"] = list(info["embeddings"]["problems"])
        return info
    manifest = model_checkpoint.read_manifest(root)
    info.update(
        version=manifest.version,
        step=manifest.step,
        created_at=iso(manifest.created_unix),
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
            forward = forward_signature(model_checkpoint.load_jit_model(manifest))
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


def csv_columns(signature: dict[str, Any]) -> str:
    """The columns ``recserve eval`` reads without ``--mapping`` for a checkpoint's feature
    ``signature`` (its manifest's dict), from :func:`clients.eval_mapping.default_mapping`:
    a multi-ID feature's IDs are separated by spaces, and the columns of a non-ID feature
    wider than 3 are shown as a range."""
    from clients.eval_mapping import default_mapping
    from embedding_store.signature import FeatureSignature

    mapping = default_mapping(FeatureSignature.from_dict(signature))
    shown = [
        spec.column + ("" if spec.separator is None else " (IDs separated by spaces)")
        for spec in mapping.id_features.values()
    ]
    for spec in mapping.non_id_features.values():
        columns = spec.columns
        shown.extend(columns if len(columns) <= 3 else [f"{columns[0]} .. {columns[-1]}"])
    return ", ".join(shown) + " (recserve eval without --mapping)"


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
        width = max((len(name) for name in info["dense_files"]), default=0)
        for name, meta in info["dense_files"].items():
            lines.append(
                f"    {name:<{width}} {meta['bytes']:>12} bytes  sha256 {meta['sha256'][:16]}…"
            )
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
            lines.append(f"  CSV columns    {csv_columns(signature)}")
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
    if info.get("verified") and not info.get("problems"):
        lines.append(
            "  verified       every file read: sizes, checksums, shapes, finite values"
            + ("" if info.get("code_loaded", True) else " (jit_dense.pt by checksum)")
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- verify
#: How the tools say that loading ``jit_dense.pt`` is asked for.
LOAD_CODE_HINT = "--load-code loads it, running code from the checkpoint: trusted ones only"


def verify(
    directory: str | os.PathLike[str], *, load_code: bool = False, check_values: bool = True
) -> tuple[list[str], dict[str, Any]]:
    """Check everything; returns (problems, summary). No exception for a bad checkpoint:
    every problem found is listed (a missing manifest or marker stops the check early).

    ``jit_dense.pt`` is TorchScript, which runs code of the checkpoint's author when loaded
    (its ``__setstate__``): it is checked against its size and checksum only, and loaded
    only with ``load_code`` (a checkpoint you trust: your own, before serving it).

    ``check_values``: NaN or Inf in embedding weights or in a parameter of ``dense.pt``
    (as its manifest lists them), NaN in embedding optimizer state or in any tensor of a
    dense file are problems (and, with ``load_code``, NaN or Inf in a TorchScript
    parameter); ``diff`` checks without, to compare checkpoints that went bad."""
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
                if name == model_checkpoint.RNG_FILE:
                    model_checkpoint.read_rng_states(manifest)  # safetensors
                elif name != model_checkpoint.JIT_FILE:
                    # tensors only, no code
                    model_checkpoint.load_state(manifest, name, check_values=check_values)
                elif load_code:
                    model_checkpoint.load_jit_model(manifest)
            except RecserveError as error:
                problems.append(error.message)
        summary["jit_model"] = manifest.has_jit_model
        summary["code_loaded"] = load_code and manifest.has_jit_model
        expected_rows, expected_shards = manifest.embedding_rows, manifest.embedding_shards
    embedding_dir = embedding_dir_of(root, kind)
    try:
        emb = checkpoint_manifest.read_manifest(embedding_dir)
    except RecserveError as error:
        problems.append(error.message)
        return problems, summary
    summary.update(embedding_files=len(emb.files), rows=emb.total_rows, shards=emb.num_shards)
    for entry in emb.files:
        try:
            read_entry(emb, entry, check_values=check_values)
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
        problem = _signature_problem(manifest, emb)
        if problem:
            problems.append(problem)
    return problems, summary


def _signature_problem(
    manifest: model_checkpoint.CheckpointManifest, emb: checkpoint_manifest.EmbeddingManifest
) -> str | None:
    """What is wrong between the feature signature and the embedding config, if anything:
    an ID feature with no slot loads, and then every request fails at its lookup."""
    if manifest.signature is None:
        return None
    slots = emb.embedding_config.slots_config
    missing = [f.name for f in manifest.signature.id_features if f.name not in slots]
    if not missing:
        return None
    return (
        f"{manifest.directory / model_checkpoint.MANIFEST_NAME}: the feature signature's ID "
        f"feature(s) {missing} have no slot in the embedding config of "
        f"{emb.directory} (its slots: {list(emb.embedding_config.slot_names)})"
    )


def require_verified(
    directory: str | os.PathLike[str], *, check_values: bool = True
) -> dict[str, Any]:
    problems, summary = verify(directory, check_values=check_values)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} failed verification:\n  - " + "\n  - ".join(problems)
        )
    return summary


def iter_problems(problems: Iterable[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)
