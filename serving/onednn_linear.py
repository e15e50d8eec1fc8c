"""The linear layers of a TorchScript dense model as oneDNN kernels, for merged batches.

Why: torch runs each ``nn.Linear`` on CPU as an MKL GEMM after copying the bias into the output,
then a separate ReLU pass. oneDNN's linear primitive, with the weight reordered once into its
own blocked layout and the ReLU fused into it, skips both extra passes. On an AMD EPYC (Zen 4,
AVX-512) the synthetic DLRM-like model's forward took 10-17% less time at 256-1024 rows, and
more at small batches: 135 against 56 us at 1 row, 465 against 444 us at 64 (its per-call
overhead dominates there). On a Zen 5 EPYC, where MKL's GEMMs are slow, it took ~0.5-0.6x the
time from 64 rows up. Each new input shape costs ~1-3 ms to build its kernel. So a server
keeps both modules: it runs this one on chunks of a few fixed sizes (:func:`chunk_sizes`,
every one built and checked at load) from a threshold up, by default one measured at load
(:func:`choose_min_rows`), and the loaded one on the rest
(:class:`serving.model.LoadedModel`).

The rewrite works on the frozen TorchScript graph, so it needs nothing from the model's Python
code: every ``aten::linear`` (followed by ``aten::relu`` or not) becomes
``mkldnn::_linear_pointwise``; a weight that is a constant of the frozen graph is reordered once.
The caller must check the result against the module as loaded before using it
(:func:`outputs_match`): only float32 on CPU is meant to take this path.
"""

from __future__ import annotations

import bisect
import functools
import time
import warnings
from collections.abc import Callable, Sequence

import torch

#: The batch size oneDNN is told to expect when it reorders a weight (a layout hint only: any
#: batch size still gives exact results).
PACKED_FOR_ROWS = 1024

#: From 256 rows, chunk sizes grow in steps of this many rows: batch-64 traffic merges into
#: multiples of 64, which then run in one call.
ROW_STEP = 64

#: Below 256 rows (a threshold chosen low, where oneDNN wins on small batches too), chunk
#: sizes grow in steps of this many rows, so that what is left for the loaded model is under
#: 16 rows (its call costs ~40-90 us whatever the rows, synthetic model). The two steps keep
#: the sizes few (at most 29 up to 1024 rows) whatever the threshold, so that load builds
#: them all quickly and oneDNN's primitive cache (1024 kernels by default) holds them: a
#: kernel for every size from 16 to 1024 rows overflowed it here, and the rebuilt kernels
#: made oneDNN slower than the loaded model.
SMALL_ROW_STEP = 16

#: Where the small steps end and the large ones begin.
LARGE_STEPS_FROM = 256

#: The threshold when oneDNN is not clearly faster on small batches (``--onednn-min-rows
#: auto``), and the rows oneDNN is told to expect when it reorders a weight for a threshold
#: chosen at load.
DEFAULT_MIN_ROWS = 256

#: The batch sizes ``auto`` times both models on at load, smallest first: the threshold is
#: the smallest of them from which oneDNN takes at most ``1 / AUTO_MIN_SPEEDUP`` of the
#: loaded model's time at every larger probe too; DEFAULT_MIN_ROWS when none does. Why it is
#: measured: the loaded model's GEMMs are MKL's, whose speed depends on the CPU. On an AMD
#: EPYC (Zen 4) oneDNN was 10-17% faster from 256 rows and slower at 64; on a Zen 5 EPYC
#: (family 26) MKL runs ~2x slower than oneDNN from 64 rows (synthetic model, 64 rows: 427
#: against 266 us; 150 rows: 924 against 480).
AUTO_PROBE_ROWS = (32, 64, 128)
AUTO_MIN_SPEEDUP = 1.25

#: Interleaved timed calls of each model per probe (the fastest counts: the least disturbed
#: by other work on the machine).
AUTO_TIMED_CALLS = 5

#: The largest chunk, unless the threshold is larger: per row, oneDNN is no faster beyond it
#: (synthetic model, us per 64 rows: 268 at 256 rows, 250 at 512, 245 at 1024, 243 at 2048).
LARGEST_CHUNK = 1024

#: How close the rewritten model's float32 outputs must be to the loaded model's. The two sum
#: the same products in a different order, so they differ by rounding only (~1e-7 measured).
RTOL = 1e-4
ATOL = 1e-4

_LINEAR_RELU = """
graph(%x, %weight, %bias):
    %y = aten::linear(%x, %weight, %bias)
    %z = aten::relu(%y)
    return (%z)"""

_LINEAR = """
graph(%x, %weight, %bias):
    %y = aten::linear(%x, %weight, %bias)
    return (%y)"""

_POINTWISE = """
graph(%x, %weight, %bias):
    %attr : str = prim::Constant[value="{attr}"]()
    %scalars : Scalar?[] = prim::ListConstruct()
    %algorithm : str? = prim::Constant()
    %y = mkldnn::_linear_pointwise(%x, %weight, %bias, %attr, %scalars, %algorithm)
    return (%y)"""

_POINTWISE_OP = "mkldnn::_linear_pointwise"


@functools.cache
def chunk_sizes(min_rows: int) -> tuple[int, ...]:
    """Every number of rows the rewritten model is ever called on, for a threshold of
    ``min_rows`` (>= 1), ascending: ``min_rows``, ``min_rows + 16``, ... below 256 rows, then
    256, 320, ... up to the largest chunk (a threshold of 256 or more: ``min_rows``,
    ``min_rows + 64``, ...).

    oneDNN builds a kernel for each input shape it meets (~1.3-3 ms for the synthetic model),
    so the sizes are few (13 for 256, 27 for 32, at most 29) and all built at load."""
    largest = max(LARGEST_CHUNK, min_rows)
    if min_rows >= LARGE_STEPS_FROM:
        return tuple(range(min_rows, largest + 1, ROW_STEP))
    small = range(min_rows, LARGE_STEPS_FROM, SMALL_ROW_STEP)
    return (*small, *range(LARGE_STEPS_FROM, largest + 1, ROW_STEP))


def chunk_size(min_rows: int, rows: int) -> int:
    """The chunk to run first on ``rows`` (>= ``min_rows``) rows: the largest of
    :func:`chunk_sizes` that fits."""
    sizes = chunk_sizes(min_rows)
    return sizes[bisect.bisect_right(sizes, rows) - 1]


def choose_min_rows(
    loaded: Callable[[int], object],
    rewritten: Callable[[int], object],
    probes: Sequence[int],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, dict[int, float]]:
    """The threshold ``--onednn-min-rows auto`` stands for, measured on this machine, and the
    time ratio (oneDNN over loaded, fastest calls) at each probe.

    ``loaded(rows)`` and ``rewritten(rows)`` each run one forward on ``rows`` rows (the same
    inputs). The two are called in turn, so that other work on the machine slows both alike.
    """
    ratios: dict[int, float] = {}
    for rows in probes:
        loaded_best = rewritten_best = float("inf")
        loaded(rows), rewritten(rows)  # builds oneDNN's kernel
        for _ in range(AUTO_TIMED_CALLS):
            started = clock()
            loaded(rows)
            middle = clock()
            rewritten(rows)
            ended = clock()
            loaded_best = min(loaded_best, middle - started)
            rewritten_best = min(rewritten_best, ended - middle)
        ratios[rows] = rewritten_best / loaded_best
    chosen = DEFAULT_MIN_ROWS
    for rows in sorted(probes, reverse=True):
        if ratios[rows] > 1.0 / AUTO_MIN_SPEEDUP:
            break
        chosen = rows
    return chosen, ratios


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the two operators the rewrite uses."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def rewrite_linear_layers(
    module: torch.jit.ScriptModule, packed_for_rows: int = PACKED_FOR_ROWS
) -> tuple[torch.jit.ScriptModule, int]:
    """A frozen copy of ``module`` (in eval mode) whose linear layers run as oneDNN kernels,
    and how many layers were rewritten (0: the copy computes as ``module`` does).

    ``module`` itself is left as it is. Raises ``RuntimeError`` when torch cannot freeze or
    rewrite it."""
    with warnings.catch_warnings():  # TorchScript is what checkpoints hold (jit_dense.pt)
        warnings.simplefilter("ignore", DeprecationWarning)
        frozen = torch.jit.freeze(module.eval())
    graph = frozen.graph
    # Linear + ReLU first, so that the ReLU is fused wherever it directly follows a linear
    # layer whose output nothing else reads (the rewriter skips matches with outside uses).
    torch._C._jit_pass_custom_pattern_based_rewrite_graph(
        _LINEAR_RELU, _POINTWISE.format(attr="relu"), graph
    )
    torch._C._jit_pass_custom_pattern_based_rewrite_graph(
        _LINEAR, _POINTWISE.format(attr="none"), graph
    )
    rewritten = 0
    for node in list(graph.nodes()):
        if node.kind() != _POINTWISE_OP:
            continue
        rewritten += 1
        weight_node = node.inputsAt(1).node()
        weight = weight_node.output().toIValue() if weight_node.kind() == "prim::Constant" else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue  # computed at run time: oneDNN takes it as it comes
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, packed_for_rows)
        # Graph.insertConstant refuses oneDNN tensors; a Constant node built by hand holds one.
        constant = graph.create("prim::Constant")
        constant.t_("value", packed)
        constant.output().inferTypeFrom(packed)
        constant.insertBefore(node)
        node.replaceInput(1, constant.output())
    torch._C._jit_pass_dce(graph)
    return frozen, rewritten


def outputs_match(rewritten: torch.Tensor, loaded: torch.Tensor) -> bool:
    """Whether the rewritten model's output equals the loaded model's up to rounding."""
    return (
        rewritten.shape == loaded.shape
        and rewritten.dtype == loaded.dtype
        and bool(torch.allclose(rewritten, loaded, rtol=RTOL, atol=ATOL))
    )
