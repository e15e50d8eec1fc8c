"""Model checkpoints: embeddings + dense model + optimizer state, tied by one manifest.

Written by training (``training.checkpoint`` adds the rank handling), read by serving and the
checkpoint tools; it lives here so that neither depends on the other.

Layout::

    manifest.json   format, version id, step, created time, SHA-256 of every dense file,
                    embedding snapshot summary (rows, shards, its version: a digest of
                    its files), and the trainer's own position (``train_state``)
    dense.pt        the dense model's state_dict (loaded with weights_only=True)
    jit_dense.pt    torch.jit.script of the dense model (for serving without Python classes)
    opt.pt          the dense optimizer's state_dict
    rng_state.safetensors  each training rank's torch random number generator states
                    (uint8 tensors ``rank_R.cpu``, ``rank_R.cuda``; no pickle)
    embeddings/     the embedding tier's checkpoint (embedding_store.checkpoint_manifest format)
    DONE            written last

The whole directory is written under a temporary name and renamed into place, so a reader
never sees half a checkpoint; the ``version`` id names the pair (dense weights, embedding
snapshot) that serving reports with every prediction.
"""

from __future__ import annotations

import copy
import hashlib
import io
import itertools
import json
import math
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import safetensors.torch
import torch

from embedding_store import checkpoint_load, checkpoint_manifest, checkpoint_publish, nonfinite
from embedding_store.errors import CheckpointError, InvalidArgumentError, RecserveError
from embedding_store.signature import FeatureSignature
from embedding_store.tier import EmbeddingTier

FORMAT_NAME = "recserve-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DONE_MARKER = "DONE"
EMBEDDINGS_DIR = "embeddings"
DENSE_FILE = "dense.pt"
JIT_FILE = "jit_dense.pt"
OPTIMIZER_FILE = "opt.pt"
SCALER_FILE = "scaler.pt"  # the mixed-precision loss scaler's state, when training used one
#: Each training rank's torch random number generator states (:func:`rng_payload`), so a
#: resumed run draws what the uninterrupted one would have (dropout); absent in older
#: checkpoints and in those written without a trainer's states.
RNG_FILE = "rng_state.safetensors"
#: The generators kept per rank: torch's CPU one and, when the rank trains on a GPU, that
#: GPU's (each as torch gives its state: uint8 [n], n fixed by the generator's kind).
RNG_KINDS = ("cpu", "cuda")
_RNG_NAME = re.compile(r"rank_(0|[1-9][0-9]{0,5})\.(cpu|cuda)")


@dataclass(frozen=True)
class CheckpointManifest:
    """The parsed manifest of a training checkpoint."""

    directory: Path
    version: str
    step: int
    created_unix: float
    files: dict[str, dict[str, Any]]  # name -> {"bytes": int, "sha256": str}
    embedding_rows: int
    embedding_shards: int
    model_class: str
    signature: FeatureSignature | None = None
    dense_optimizer_class: str = ""  # e.g. "torch.optim.adam.Adam"; "" in older checkpoints
    #: The version of the embedding snapshot written with the dense files
    #: (``EmbeddingManifest.version``); "" in older checkpoints.
    embedding_version: str = ""
    #: What the trainer recorded about where it was (e.g. epochs done, the seed): JSON
    #: numbers, strings, booleans or null by name. Empty when it recorded nothing.
    train_state: dict[str, Any] = field(default_factory=dict)
    #: The names in ``dense.pt`` that are the model's parameters, where +-Inf is refused as
    #: well as NaN (its other tensors are buffers and extra state, which may hold +-Inf: a
    #: mask); None in older checkpoints, whose ``dense.pt`` is checked for NaN only unless
    #: the model is at hand (a resume).
    dense_parameters: frozenset[str] | None = None

    @property
    def has_jit_model(self) -> bool:
        return JIT_FILE in self.files

    @property
    def embeddings_directory(self) -> Path:
        return self.directory / EMBEDDINGS_DIR


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _quiet_jit(function: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """Call a torch.jit function without its deprecation warning: TorchScript is the format
    this checkpoint promises (``jit_dense.pt``), for runtimes without the model's Python."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return function(*args, **kwargs)


def _save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def script_model(model: torch.nn.Module) -> torch.jit.ScriptModule:
    """TorchScript the dense model, or explain what its forward must look like."""
    try:
        return _quiet_jit(torch.jit.script, model)
    except Exception as error:
        raise InvalidArgumentError(
            f"cannot TorchScript {type(model).__name__}: {error}. The dense model's forward must "
            "be `forward(self, non_id_tensors: List[Tensor], embedding_tensors: List[Tensor])` "
            'and scriptable (docs/own_model.md, "The model contract"). with_jit_model=False '
            "writes the checkpoint without jit_dense.pt: training resumes from it, but recserve "
            "serve and InferCtx, which run the TorchScript model, cannot load it"
        ) from None


def write_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    dense_optimizer: torch.optim.Optimizer | None,
    tier: EmbeddingTier,
    *,
    step: int = 0,
    signature: FeatureSignature | None = None,
    with_jit_model: bool = True,
    overwrite: bool = False,
    grad_scaler: torch.amp.GradScaler | None = None,
    train_state: dict[str, Any] | None = None,
    rng_states: Sequence[dict[str, torch.Tensor]] | None = None,
) -> CheckpointManifest:
    """Write a complete checkpoint atomically (staging directory, then one rename).

    ``grad_scaler``: an enabled mixed-precision loss scaler's state goes to ``scaler.pt``, so
    a resumed run keeps its loss scale instead of starting again from 65536.
    ``train_state``: the trainer's position (:attr:`CheckpointManifest.train_state`).
    ``rng_states``: each rank's random number generator states, by rank (see
    :func:`rng_payload`), written to ``rng_state.safetensors``.

    Values that a load refuses are refused here, naming the tensor and its first bad value:
    in the dense files before anything is written (:func:`check_dense_writable`), in the
    embedding rows by each shard as it writes them
    (:func:`embedding_store.checkpoint_dump.write_shard_part`). The staging directory is
    then removed and a checkpoint already at ``directory`` is left as it was."""
    train_state = check_train_state(train_state, "train_state")
    target = Path(directory).absolute()
    checkpoint_publish.check_target(target, overwrite=overwrite)
    # A DDP wrapper's .module (torch types Module.__getattr__ as Tensor | Module).
    model = cast(torch.nn.Module, model.module) if hasattr(model, "module") else model
    state = model.state_dict()
    parameters = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
    optimizer_state = dense_optimizer.state_dict() if dense_optimizer is not None else None
    scaler_state = (
        grad_scaler.state_dict() if grad_scaler is not None and grad_scaler.is_enabled() else None
    )
    # Before anything is written (and before the embedding dump, which takes longest).
    check_dense_writable(target, model, state, optimizer_state, scaler_state)
    payloads = {DENSE_FILE: _save_bytes({k: v.cpu() for k, v in state.items()})}
    if optimizer_state is not None:
        payloads[OPTIMIZER_FILE] = _save_bytes(optimizer_state)
    if scaler_state is not None:
        payloads[SCALER_FILE] = _save_bytes(scaler_state)
    if rng_states is not None:
        payloads[RNG_FILE] = rng_payload(rng_states)
    if with_jit_model:
        buffer = io.BytesIO()
        # Each module's own mode is put back, not the root's with train(mode): that would
        # switch a part the trainer keeps in eval mode (a frozen layer) to training.
        modes = [(module, module.training) for module in model.modules()]
        scripted = script_model(model)
        scripted.eval()
        _quiet_jit(torch.jit.save, scripted, buffer)
        for module, training in modes:
            module.training = training
        payloads[JIT_FILE] = buffer.getvalue()
    staging = checkpoint_publish.staging_directory_for(target)
    try:
        try:
            embedding_manifest = tier.dump(staging / EMBEDDINGS_DIR)
        except RecserveError as error:  # it names the staging directory, not the target
            raise type(error)(f"checkpoint {target} not written: {error.message}") from None
        for name, payload in payloads.items():
            checkpoint_publish.write_atomic(staging / name, payload)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "version": f"{step:08d}-{uuid.uuid4().hex[:8]}",
            "step": step,
            "created_unix": time.time(),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model_class": _class_name(model),
            "dense_optimizer_class": (
                _class_name(dense_optimizer) if dense_optimizer is not None else ""
            ),
            "files": {
                name: {"bytes": len(p), "sha256": hashlib.sha256(p).hexdigest()}
                for name, p in payloads.items()
            },
            "signature": signature.to_dict() if signature is not None else None,
            "embeddings": {
                "directory": EMBEDDINGS_DIR,
                "rows": embedding_manifest.total_rows,
                "shards": embedding_manifest.num_shards,
                "version": embedding_manifest.version,
            },
            "train_state": train_state,
            # A state dict does not tell parameters from buffers: the readers that load no
            # model (verify, inspect) take this list to refuse Inf in a parameter.
            "dense_parameters": [name for name in state if name in parameters],
        }
        checkpoint_publish.write_atomic(
            staging / MANIFEST_NAME, json.dumps(manifest, indent=2).encode()
        )
        checkpoint_publish.write_atomic(staging / DONE_MARKER, b"")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    checkpoint_publish.publish_directory(staging, target, overwrite=overwrite)
    return read_manifest(target)


def read_manifest(directory: str | Path) -> CheckpointManifest:
    """Parse a checkpoint's manifest; CheckpointError names what is missing or wrong."""
    root = Path(directory)
    if not checkpoint_manifest.is_directory(root):
        raise CheckpointError(
            f"checkpoint {root} does not exist or is not a directory"
            + checkpoint_manifest.interrupted_overwrite_hint(root)
        )
    if not (root / DONE_MARKER).exists():
        raise CheckpointError(checkpoint_manifest.no_done_marker_message(root, "checkpoint", ""))
    try:
        raw = json.loads((root / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        hint = ""
        if (root / checkpoint_manifest.MANIFEST_NAME).exists():
            hint = f": {root} is an embedding checkpoint"
            if (root.parent / MANIFEST_NAME).exists():
                hint += f", part of the model checkpoint {root.parent}"
        raise CheckpointError(f"checkpoint {root} has no {MANIFEST_NAME}{hint}") from None
    except (OSError, ValueError, RecursionError) as error:  # Recursion: nested too deep
        raise CheckpointError(f"{root / MANIFEST_NAME} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{root / MANIFEST_NAME} is malformed: a JSON {type(raw).__name__}, not an object"
        )
    try:
        if raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{root / MANIFEST_NAME} is not a {FORMAT_NAME} manifest")
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"{root} has checkpoint format version {raw['format_version']}; this build "
                f"reads version {FORMAT_VERSION}"
            )
        return CheckpointManifest(
            directory=root,
            version=str(raw["version"]),
            step=_whole_number(raw["step"], "step", root),
            created_unix=float(raw["created_unix"]),
            files=_file_entries(raw["files"], root / MANIFEST_NAME),
            embedding_rows=_whole_number(raw["embeddings"]["rows"], "embeddings.rows", root),
            embedding_shards=_whole_number(raw["embeddings"]["shards"], "embeddings.shards", root),
            model_class=str(raw.get("model_class", "")),
            dense_optimizer_class=str(raw.get("dense_optimizer_class", "")),
            signature=(
                FeatureSignature.from_dict(raw["signature"], str(root / MANIFEST_NAME))
                if raw.get("signature")
                else None
            ),
            embedding_version=str(raw["embeddings"].get("version", "")),
            train_state=check_train_state(
                raw.get("train_state"), f"{root / MANIFEST_NAME}: train_state", CheckpointError
            ),
            dense_parameters=_names(raw.get("dense_parameters"), "dense_parameters", root),
        )
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # int(Infinity)
        raise CheckpointError(f"{root / MANIFEST_NAME} is malformed: {error!r}") from None


def _whole_number(value: object, field: str, root: Path) -> int:
    """A manifest count: a JSON integer >= 0 (not 1.5, "12" or true, which int() would take)."""
    if type(value) is not int or value < 0:
        raise CheckpointError(
            f"{root / MANIFEST_NAME} is malformed: {field} must be an integer >= 0, got {value!r}"
        )
    return value


def _names(value: object, field: str, root: Path) -> frozenset[str] | None:
    """A manifest's list of names (JSON strings); None when absent (an older checkpoint)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise CheckpointError(
            f"{root / MANIFEST_NAME} is malformed: {field} must be a list of names, got {value!r}"
        )
    return frozenset(value)


def check_train_state(
    value: object, where: str, error: type[Exception] = InvalidArgumentError
) -> dict[str, Any]:
    """``value`` as a train state: None (nothing recorded) or a mapping of string names to
    JSON scalars (numbers, strings, booleans, null); ``error`` naming ``where`` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise error(f"{where} must be a mapping of names to numbers or strings, got {value!r}")
    for name, item in value.items():
        if not isinstance(name, str) or not (
            item is None or isinstance(item, (bool, int, float, str))
        ):
            raise error(
                f"{where}: {name!r} must name a number, string, boolean or None, got {item!r}"
            )
        if isinstance(item, float) and not math.isfinite(item):
            raise error(f"{where}: {name!r} must be finite, got {item!r}")
    return dict(value)


def check_embeddings_match(
    manifest: CheckpointManifest, embeddings: checkpoint_manifest.EmbeddingManifest
) -> None:
    """CheckpointError unless ``embeddings`` is the snapshot written with the dense files (a
    directory swapped in by hand would otherwise be served under this version)."""
    if manifest.embedding_version and embeddings.version != manifest.embedding_version:
        raise CheckpointError(
            f"{manifest.directory / EMBEDDINGS_DIR} holds embedding checkpoint "
            f"{embeddings.version}, but {manifest.directory / MANIFEST_NAME} was written with "
            f"{manifest.embedding_version}: the embeddings were replaced after the dump"
        )


def _file_entries(files: Any, where: Path) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: {name: {"bytes": int >= 0, "sha256": 64 hex digits}}, each
    name a plain file name; CheckpointError naming the entry otherwise."""
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{where} is malformed: 'files' must be an object, got a JSON {type(files).__name__}"
        )
    for name, entry in files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{where} is malformed: file name {name!r} is not a plain name")
        if not isinstance(entry, dict):
            raise CheckpointError(
                f"{where} is malformed: files[{name!r}] must be an object, got a JSON "
                f"{type(entry).__name__}"
            )
        size = entry.get("bytes")
        if type(size) is not int or size < 0:
            raise CheckpointError(
                f"{where} is malformed: files[{name!r}].bytes must be an integer >= 0, got {size!r}"
            )
        if not checkpoint_manifest.is_sha256_hex(entry.get("sha256")):
            raise CheckpointError(
                f"{where} is malformed: files[{name!r}].sha256 must be 64 hex digits, "
                f"got {entry.get('sha256')!r}"
            )
    return dict(files)


def read_verified_file(manifest: CheckpointManifest, name: str) -> bytes:
    """The bytes of a dense file, checked against the manifest's size and SHA-256."""
    if name not in manifest.files:
        raise CheckpointError(f"checkpoint {manifest.directory} has no {name}")
    path = manifest.directory / name
    try:
        payload = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    expected = manifest.files[name]
    if len(payload) != expected["bytes"]:
        raise CheckpointError(
            f"{path} has {len(payload)} bytes; the manifest says {expected['bytes']} "
            "(truncated or replaced)"
        )
    if hashlib.sha256(payload).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{path} is corrupt: SHA-256 mismatch")
    return payload


def load_state(manifest: CheckpointManifest, name: str, *, check_values: bool = True) -> Any:
    """A dense file's contents via ``torch.load(weights_only=True)`` (no arbitrary pickle).

    CheckpointError naming the file, the tensor and the first bad position and value when a
    tensor anywhere in it holds NaN, or a parameter of ``dense.pt`` (as the manifest lists
    them) holds +-Inf (see :func:`check_no_nan`), unless not ``check_values`` (``recserve
    checkpoint diff``, which shows what went bad)."""
    payload = read_verified_file(manifest, name)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{manifest.directory / name} cannot be loaded: {error}") from None
    if check_values:
        finite = manifest.dense_parameters if name == DENSE_FILE else None
        check_no_nan(state, manifest.directory / name, finite=finite or frozenset())
    return state


def rng_payload(states: Sequence[dict[str, torch.Tensor]]) -> bytes:
    """``rng_state.safetensors``: ``states[R]`` (rank R's generator states by kind, of
    :data:`RNG_KINDS`: uint8 [n] each) as tensors ``rank_R.KIND``. safetensors, not
    ``torch.save``: nothing read from disk is unpickled."""
    tensors = {}
    for rank, state in enumerate(states):
        for kind, value in state.items():
            if kind not in RNG_KINDS or value.dtype != torch.uint8 or value.dim() != 1:
                raise InvalidArgumentError(
                    f"rank {rank}'s random number generator state {kind!r} must be a uint8 "
                    f"[n] tensor of one of {list(RNG_KINDS)}, got {value.dtype} "
                    f"{list(value.shape)}"
                )
            # A copy each: safetensors refuses tensors that share memory (ranks alike).
            tensors[f"rank_{rank}.{kind}"] = value.detach().cpu().clone()
    return safetensors.torch.save(tensors, metadata={"format": "recserve-rng-state"})


def read_rng_states(manifest: CheckpointManifest) -> list[dict[str, torch.Tensor]] | None:
    """The random number generator states of ``rng_state.safetensors`` by rank (as
    :func:`rng_payload` was given them), verified against the manifest first; None when the
    checkpoint has none (written before they were kept). CheckpointError naming the file when
    it is corrupt or malformed."""
    if RNG_FILE not in manifest.files:
        return None
    where = manifest.directory / RNG_FILE
    payload = read_verified_file(manifest, RNG_FILE)
    try:
        tensors = safetensors.torch.load(payload)
    except Exception as error:  # safetensors' own error type is not exported
        raise CheckpointError(f"{where} cannot be loaded: {error}") from None
    states: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _RNG_NAME.fullmatch(name)
        if match is None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise CheckpointError(
                f"{where} is malformed: tensor {name!r} ({tensor.dtype} {list(tensor.shape)}) "
                "is not a generator state rank_R.cpu or rank_R.cuda (uint8 [n])"
            )
        states.setdefault(int(match[1]), {})[match[2]] = tensor
    if sorted(states) != list(range(len(states))):
        raise CheckpointError(
            f"{where} is malformed: it holds the states of ranks {sorted(states)}, not of "
            f"ranks 0..{len(states) - 1}"
        )
    return [states[rank] for rank in range(len(states))]


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every tensor in a loaded state (nested dicts, lists and
    tuples, as an optimizer's ``{"state": {0: {"exp_avg": ...}}}``), in order."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}" if prefix else str(index))


def _nonfinite_error(
    where: Path, name: str, tensor: torch.Tensor, first: int, nan_only: bool
) -> CheckpointError:
    """The error for tensor ``name`` of ``where``, whose flat value ``first`` is bad."""
    return CheckpointError(
        f"{where} is corrupt: {_bad_tensor(f'tensor {name!r}', tensor, first, nan_only)}"
    )


def _bad_tensor(label: str, tensor: torch.Tensor, first: int, nan_only: bool) -> str:
    """``tensor 'fc.weight' holds 1 NaN value(s), the first at [0, 2]: nan`` for ``label``
    ``tensor 'fc.weight'``: what is bad in ``tensor`` (any device), whose flat value
    ``first`` is. The error path only."""
    stored = nonfinite.stored_values(tensor)  # a sparse tensor: its stored values
    values = stored.reshape(-1).to(torch.float64).cpu().numpy()
    return (
        f"{label} holds "
        f"{nonfinite.describe(values, first, tuple(stored.shape), nan_only=nan_only)}"
        + ("" if tensor.layout == torch.strided else " (among its stored values)")
    )


def check_dense_writable(
    target: Path,
    model: torch.nn.Module,
    state: dict[str, Any],
    optimizer_state: Any,
    scaler_state: Any,
) -> None:
    """CheckpointError naming ``target``, the tensor and its first bad value unless a load
    would take these dense values: every parameter of ``model`` finite, and no NaN in its
    buffers (+-Inf is kept: a mask), in any other tensor of ``state`` (its state_dict:
    ``dense.pt``), of ``optimizer_state`` (``opt.pt``) or of ``scaler_state``
    (``scaler.pt``; both None when not written). That is what :func:`load_state`,
    :func:`load_checkpoint` and :func:`load_jit_model` refuse: a checkpoint of them would
    replace the one at ``target`` (with overwrite) by one that serving and resuming refuse.
    Each tensor is read once, in chunks."""
    # Every name of a shared (tied) tensor, as the state dict has them; non-persistent
    # buffers too: the TorchScript model has them.
    parameters = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    checks = itertools.chain(
        ((f"the dense model's parameter {n!r}", t, False) for n, t in parameters.items()),
        ((f"the dense model's buffer {n!r}", t, True) for n, t in buffers.items()),
        (  # what else the state dict holds (extra state); the rest was checked just above
            (f"tensor {n!r} of the dense model's state dict", t, True)
            for n, t in _tensors(state)
            if n not in parameters and n not in buffers
        ),
        (
            (f"tensor {n!r} of the dense optimizer's state ({OPTIMIZER_FILE})", t, True)
            for n, t in _tensors(optimizer_state)
        ),
        (
            (f"tensor {n!r} of the loss scaler's state ({SCALER_FILE})", t, True)
            for n, t in _tensors(scaler_state)
        ),
    )
    for label, tensor, nan_only in checks:
        first = nonfinite.first_bad_index_torch(tensor, nan_only=nan_only)
        if first is not None:
            raise CheckpointError(
                f"checkpoint {target} not written: "
                f"{_bad_tensor(label, tensor, first, nan_only)}. {nonfinite.NOT_WRITTEN}"
            )


def check_no_nan(state: Any, where: Path, *, finite: frozenset[str] = frozenset()) -> None:
    """CheckpointError naming ``where`` (a dense file), the tensor and its first bad value
    unless no tensor of ``state`` holds NaN and none named in ``finite`` (the parameters of
    a state dict) holds +-Inf. NaN is never a trained value: a model or optimizer that holds
    one answers NaN (or trains to NaN) from then on. +-Inf is refused only in parameters: a
    buffer may hold it on purpose (an attention mask of -inf), and so may an optimizer's
    state (an Adagrad sum past float32's range, whose step is then 0); a state dict alone
    does not tell buffers from parameters, so the writer lists them (``finite``)."""
    for name, tensor in _tensors(state):
        nan_only = name not in finite
        first = nonfinite.first_bad_index_torch(tensor, nan_only=nan_only)
        if first is not None:
            raise _nonfinite_error(where, name, tensor, first, nan_only=nan_only)


def check_finite_parameters(
    parameters: Iterable[tuple[str, torch.Tensor]],
    buffers: Iterable[tuple[str, torch.Tensor]],
    where: Path,
) -> None:
    """CheckpointError naming ``where``, the tensor and its first bad value unless every
    parameter is finite and no buffer holds NaN (buffers may hold +-Inf: a mask)."""
    for (name, tensor), nan_only in itertools.chain(
        ((item, False) for item in parameters), ((item, True) for item in buffers)
    ):
        first = nonfinite.first_bad_index_torch(tensor, nan_only=nan_only)
        if first is not None:
            raise _nonfinite_error(where, name, tensor, first, nan_only=nan_only)


def _class_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _check_optimizer_fits(
    manifest: CheckpointManifest, optimizer: torch.optim.Optimizer, saved: Any
) -> None:
    """Refuse optimizer state written by another kind of optimizer: torch would load it and
    silently take its hyperparameters (an SGD run resumed from Adam's state gets Adam's
    learning rate and betas in its param groups)."""
    where = manifest.directory / OPTIMIZER_FILE
    current = _class_name(optimizer)
    if manifest.dense_optimizer_class:
        if manifest.dense_optimizer_class != current:
            raise CheckpointError(
                f"{where} was written by {manifest.dense_optimizer_class}; this run's dense "
                f"optimizer is {current}. Use the same optimizer to resume"
            )
        return
    # Checkpoints written before the class was recorded: the param groups' keys tell.
    try:
        saved_keys = [sorted(group) for group in saved["param_groups"]]
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{where} is not an optimizer state dict: {error!r}") from None
    current_keys = [sorted(group) for group in optimizer.state_dict()["param_groups"]]
    if saved_keys != current_keys:
        raise CheckpointError(
            f"{where} does not fit {current}: its param groups have the settings "
            f"{saved_keys[:1]}, this optimizer's {current_keys[:1]}"
        )


def load_jit_model(manifest: CheckpointManifest) -> torch.jit.ScriptModule:
    """The TorchScript dense model of a checkpoint, verified first."""
    payload = read_verified_file(manifest, JIT_FILE)
    try:
        module = _quiet_jit(torch.jit.load, io.BytesIO(payload), map_location="cpu")
    except Exception as error:
        raise CheckpointError(
            f"{manifest.directory / JIT_FILE} cannot be loaded: {error}"
        ) from None
    # What serving runs: NaN or Inf in a weight would answer NaN for every request.
    check_finite_parameters(
        module.named_parameters(), module.named_buffers(), manifest.directory / JIT_FILE
    )
    return module


def verify(directory: str | Path) -> CheckpointManifest:
    """Check every dense file and every embedding file against the manifests, and their
    values (no NaN in a dense file's tensors and no Inf in a parameter of ``dense.pt``, see
    :func:`load_state`; none in embeddings, see
    :func:`embedding_store.checkpoint_load.verify`). ``jit_dense.pt`` is code: checked by
    checksum only."""
    manifest = read_manifest(directory)
    for name in manifest.files:
        if name == JIT_FILE:
            read_verified_file(manifest, name)
        elif name == RNG_FILE:
            read_rng_states(manifest)
        else:
            load_state(manifest, name)  # verified first, then loaded with weights_only
    check_embeddings_match(manifest, checkpoint_load.verify(manifest.embeddings_directory))
    return manifest


def load_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    dense_optimizer: torch.optim.Optimizer | None,
    tier: EmbeddingTier,
    *,
    load_embeddings: bool = True,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> CheckpointManifest:
    """Restore dense weights, optimizer state, an enabled ``grad_scaler``'s state (when the
    checkpoint has one) and (unless ``load_embeddings`` is False, e.g. on DDP ranks other
    than 0 sharing one tier) embeddings.

    The dense files are verified before anything moves; the tier verifies the embeddings
    before it changes (``EmbeddingTier.load``). Any failure (a corrupt file, a state dict that
    does not fit the model or the optimizer, a tier that refuses the embeddings) puts the
    model's weights and the optimizer's state back as they were: all or nothing.
    """
    manifest = read_manifest(directory)
    state = load_state(manifest, DENSE_FILE)
    optimizer_state = (
        load_state(manifest, OPTIMIZER_FILE)
        if dense_optimizer is not None and OPTIMIZER_FILE in manifest.files
        else None
    )
    scaler_state = (
        load_state(manifest, SCALER_FILE)
        if grad_scaler is not None and grad_scaler.is_enabled() and SCALER_FILE in manifest.files
        else None
    )
    # A DDP wrapper's .module (torch types Module.__getattr__ as Tensor | Module).
    model = cast(torch.nn.Module, model.module) if hasattr(model, "module") else model
    # Refused, not warned about: from NaN or Inf weights every step's gradients are NaN,
    # which the non-finite step guard skips, so the run would go on learning nothing.
    # (NaN anywhere was refused by load_state, and Inf in the parameters the manifest
    # lists; a checkpoint written before it listed them is checked against the model's.)
    parameter_names = {name for name, _ in model.named_parameters()}
    check_finite_parameters(
        ((name, value) for name, value in state.items() if name in parameter_names)
        if isinstance(state, dict)
        else (),
        (),
        manifest.directory / DENSE_FILE,
    )
    # load_state_dict copies tensor by tensor and reports a mismatch at the end: keep copies.
    previous_weights = {
        name: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for name, value in model.state_dict().items()
    }
    previous_optimizer = None
    if optimizer_state is not None:
        assert dense_optimizer is not None  # optimizer_state is read only with an optimizer
        previous_optimizer = copy.deepcopy(dense_optimizer.state_dict())
    previous_scaler = None
    if scaler_state is not None:
        assert grad_scaler is not None  # scaler_state is read only with a scaler
        previous_scaler = grad_scaler.state_dict()
    try:
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            raise CheckpointError(
                f"{manifest.directory / DENSE_FILE} does not fit {type(model).__name__}: {error}"
            ) from None
        if optimizer_state is not None:
            assert dense_optimizer is not None  # optimizer_state is read only with an optimizer
            _check_optimizer_fits(manifest, dense_optimizer, optimizer_state)
            try:
                dense_optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError) as error:
                raise CheckpointError(
                    f"{manifest.directory / OPTIMIZER_FILE} does not fit the optimizer: {error}"
                ) from None
        if scaler_state is not None:
            assert grad_scaler is not None  # scaler_state is read only with a scaler
            try:
                grad_scaler.load_state_dict(scaler_state)
            except (RuntimeError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointError(
                    f"{manifest.directory / SCALER_FILE} is not a loss scaler's state: {error!r}"
                ) from None
        if load_embeddings:
            check_embeddings_match(
                manifest, checkpoint_manifest.read_manifest(manifest.embeddings_directory)
            )
            tier.load(manifest.embeddings_directory)
    except BaseException:
        model.load_state_dict(previous_weights)
        if previous_optimizer is not None:
            assert dense_optimizer is not None  # previous_optimizer is set only with one
            dense_optimizer.load_state_dict(previous_optimizer)
        if previous_scaler is not None:
            assert grad_scaler is not None  # previous_scaler is set only with one
            grad_scaler.load_state_dict(previous_scaler)
        raise
    return manifest
