"""``recserve checkpoint diff``: what differs between two checkpoints of the same kind, per ID
space (rows added, removed and changed, optimizer state) and per dense tensor, and its text.
The other files of a model checkpoint (``jit_dense.pt``, ``opt.pt``, ``scaler.pt`` and the
random number generators' ``rng_state.safetensors``) are compared by checksum.

Both checkpoints are verified first. ``diff`` reads the embedding rows of both checkpoints
into memory: plan memory for tables of that size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from clients.checkpoint_common import (
    ALL_SPACES,
    MODEL,
    embedding_dir_of,
    read_entry,
    space_names,
)
from clients.checkpoint_inspect import require_verified
from embedding_store import checkpoint_manifest, model_checkpoint
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import CheckpointError, InvalidArgumentError

__all__ = ["diff", "format_diff"]


def _slots_of(config: EmbeddingConfig) -> dict[str, list[str]]:
    spaces: dict[str, list[str]] = {}
    for name in config.slot_names:
        key = config.id_space_of(name) if config.feature_index_prefix_bit else ALL_SPACES
        spaces.setdefault(key, []).append(name)
    return spaces


def _rows_by_space(
    manifest: checkpoint_manifest.EmbeddingManifest,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """ID space -> (masked IDs sorted, weights and optimizer state in that order), every
    file verified."""
    config = manifest.embedding_config
    mask = np.uint64(config.id_mask)
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for entry in manifest.files:
        tensors = read_entry(manifest, entry, check_values=False)  # see diff()
        ids, weights, state = tensors["ids"], tensors["weights"], tensors["state"]
        index, names = space_names(config, ids)
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
    ma, mb = checkpoint_manifest.read_manifest(a), checkpoint_manifest.read_manifest(b)
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
            # Common IDs: the space is in both checkpoints, so neither side is the default.
            assert w_a is not None and w_b is not None and st_a is not None and st_b is not None
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
    sa = model_checkpoint.load_state(ma, model_checkpoint.DENSE_FILE, check_values=False)
    sb = model_checkpoint.load_state(mb, model_checkpoint.DENSE_FILE, check_values=False)
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
#: The random number generators' states count: a run resumed from either checkpoint draws
#: other random numbers (dropout) when they differ, even with every weight the same.
_CHECKSUMMED = (
    model_checkpoint.JIT_FILE,
    model_checkpoint.OPTIMIZER_FILE,
    model_checkpoint.SCALER_FILE,
    model_checkpoint.RNG_FILE,
)


def _article(word: str) -> str:
    """ "an" before a vowel ("an embedding checkpoint"), else "a" ("a model checkpoint")."""
    return "an" if word[:1].lower() in "aeiou" else "a"


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
    change while ``dense.pt`` does not), ``opt.pt``, ``scaler.pt`` and
    ``rng_state.safetensors`` (each training rank's random number generators; one
    checkpoint with the file and one without differ too)."""
    a, b = Path(directory_a), Path(directory_b)
    # NaN or Inf weights are no problem here: finding the rows that went bad between two
    # checkpoints is what diff is for (every other check stands).
    kind_a = require_verified(a, check_values=False)["kind"]
    kind_b = require_verified(b, check_values=False)["kind"]
    if kind_a != kind_b:
        raise InvalidArgumentError(
            f"{a} is {_article(kind_a)} {kind_a} checkpoint but {b} is {_article(kind_b)} "
            f"{kind_b} one"
        )
    result: dict[str, Any] = {"a": str(a), "b": str(b), "kind": kind_a, "tolerance": tolerance}
    result["embeddings"] = _diff_embeddings(
        embedding_dir_of(a, kind_a), embedding_dir_of(b, kind_b), tolerance
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
                # The TorchScript code, the dense optimizer's state, the loss scale and
                # the random number generators: compared by checksum.
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
