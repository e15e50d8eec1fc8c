"""``recserve eval`` and ``recserve checkpoint ...`` (registered via ``recserve.commands``).

Handlers import their modules lazily so that ``recserve --help`` stays fast.

Exit codes: 0 success; 1 an error (bad input, bad rows with ``--bad-rows fail``, a checkpoint
that fails verification, refusing to overwrite); 2 usage errors (argparse); 3 ``eval --compare``
found predictions that differ; ``checkpoint diff --exit-code`` returns 1 when the checkpoints
differ.
"""

from __future__ import annotations

import argparse
import json
import sys

from clients._tls import add_tls_arguments
from embedding_store.checkpoint_manifest import MAX_SHARDS
from embedding_store.cli_types import (
    int_in_range,
    non_empty_path,
    non_negative_float,
    positive_float,
    positive_int,
)


# --------------------------------------------------------------------------- eval
def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a data set with a checkpoint or a server; predictions, report, parity",
        description=(
            "Score CSV/Parquet rows (streamed in chunks) in-process from a checkpoint or "
            "through a running server, write predictions, and optionally an evaluation report "
            "(AUC, log loss, calibration, plots). --compare scores both ways and fails (exit 3) "
            "when predictions differ: the parity check before a rollout."
        ),
    )
    parser.add_argument("--checkpoint", type=non_empty_path, metavar="DIR", help="score in-process")
    parser.add_argument("--url", metavar="URL", help="score through a server (http(s)://HOST:PORT)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="score in-process (--checkpoint) AND through the server (--url); exit 3 when "
        "any prediction differs by more than --tolerance",
    )
    parser.add_argument(
        "--data",
        type=non_empty_path,
        nargs="+",
        required=True,
        metavar="FILE",
        help=".csv[.gz] or .parquet",
    )
    parser.add_argument(
        "--out", type=non_empty_path, required=True, help="predictions file (.csv or .parquet)"
    )
    parser.add_argument(
        "--mapping",
        type=non_empty_path,
        metavar="YML",
        help="feature_mapping.yml. Default: one column per model feature, named like it. An "
        "ID feature's column holds an integer ID; a multi-ID feature's holds integer IDs "
        "separated by spaces, e.g. '71 282 62' (empty: no IDs), not a JSON list. A non-ID "
        "feature of width 1 is read from column NAME; of width k > 1 from columns NAME_0 .. "
        "NAME_{k-1}, one number each (e.g. dense_0, dense_1, dense_2), not one column holding "
        "a list. `recserve checkpoint inspect DIR` shows the features and widths",
    )
    labels = parser.add_mutually_exclusive_group()
    labels.add_argument("--label", metavar="COL", help="label column (overrides the mapping's)")
    labels.add_argument(
        "--no-label", action="store_true", help="ignore the mapping's label: predictions only"
    )
    parser.add_argument(
        "--report", type=non_empty_path, metavar="DIR", help="write an evaluation report"
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=4096,
        help="rows per chunk/request (4096; with --url, a chunk over the server's "
        "--max-request-batch-size goes in requests of that size)",
    )
    parser.add_argument(
        "--bad-rows",
        choices=["skip", "fail"],
        default="fail",
        help="rows that cannot be read or encoded, each reported as FILE:LINE: reason "
        "(naming the column or feature): report and skip, or fail (default); a first chunk "
        "of which no row encodes fails either way (the mapping does not fit the data)",
    )
    parser.add_argument("--model", default="model", help="the server's model name (model)")
    parser.add_argument(
        "--output-transform",
        choices=["identity", "sigmoid"],
        default="identity",
        help="applied in-process (--checkpoint) to the model output, as `recserve serve "
        "--output-transform` does on the server (use the server's setting with --compare; "
        "with --url alone the server's answers are used as they come)",
    )
    parser.add_argument(
        "--protocol",
        choices=["v2", "friendly"],
        default="v2",
        help="v2: rows encoded here, sent as KServe v2 binary tensors (default); friendly: raw "
        "rows to /v1/models/NAME:predict, encoded by the server's --preprocessor",
    )
    parser.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=1e-6,
        help="max abs difference allowed by --compare (1e-6; only with --compare)",
    )
    parser.add_argument(
        "--calibration-bins", type=positive_int, default=10, help="reliability bins (10)"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=60.0, help="per request, seconds (60)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing --out / --report (a --report directory only when it is empty "
        "or holds an earlier report)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    add_tls_arguments(parser)
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from clients.eval import EvalOptions, run_eval

    result = run_eval(
        EvalOptions(
            data=tuple(args.data),
            out=args.out,
            checkpoint=args.checkpoint,
            url=args.url,
            compare=args.compare,
            mapping=args.mapping,
            label=args.label,
            no_label=args.no_label,
            report=args.report,
            batch_size=args.batch_size,
            bad_rows=args.bad_rows,
            model=args.model,
            output_transform=args.output_transform,
            protocol=args.protocol,
            tolerance=args.tolerance,
            overwrite=args.overwrite,
            timeout=args.timeout,
            calibration_bins=args.calibration_bins,
            progress=not args.quiet,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    )
    return result.exit_code


# --------------------------------------------------------------------------- checkpoint
_LOAD_CODE_HELP = (
    "also load jit_dense.pt; it is TorchScript, and loading runs code of whoever wrote the "
    "checkpoint: only for checkpoints you trust"
)


def _register_checkpoint(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint",
        help="inspect, verify, reshard, diff or export a checkpoint (offline)",
        description="Offline tools for model checkpoints (manifest.json + dense files + "
        "embeddings/) and bare embedding checkpoints. Writers never replace an existing target "
        "unless --overwrite, and never leave a partial one.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    inspect = actions.add_parser(
        "inspect",
        help="version, step, slots, shards, signatures",
        description="What a checkpoint holds. Exits 1 when it lists a problem (a dense file "
        "that does not load or holds NaN or Inf, an unreadable embedding file); --verify also "
        "reads and checks every file.",
    )
    inspect.add_argument("directory", type=non_empty_path, metavar="DIR")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--load-code", action="store_true", help=_LOAD_CODE_HELP + " (shows its forward signature)"
    )
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also read and check every file, as `checkpoint verify` (sizes, checksums, "
        "shapes, NaN/Inf in weights, the feature signature against the embedding config)",
    )
    inspect.set_defaults(handler=_inspect)

    verify = actions.add_parser(
        "verify",
        help="check completeness and every checksum",
        description="Check a checkpoint's files against its manifests (sizes, SHA-256), load "
        "its tensors (shapes, dtypes, rows; NaN or Inf in embedding rows and dense parameters, "
        "NaN in the other tensors of the dense files) and compare embeddings, manifest and "
        "feature signature. Its TorchScript (jit_dense.pt) is checked by checksum only: "
        "loading it runs code of whoever wrote the checkpoint (--load-code also checks its "
        "parameters for NaN and Inf).",
    )
    verify.add_argument("directories", type=non_empty_path, nargs="+", metavar="DIR")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument("--load-code", action="store_true", help=_LOAD_CODE_HELP)
    verify.set_defaults(handler=_verify)

    reshard = actions.add_parser("reshard", help="rewrite the embeddings with N shards")
    reshard.add_argument("directory", type=non_empty_path, metavar="DIR")
    reshard.add_argument(
        "--shards",
        type=int_in_range(1, MAX_SHARDS),  # what a manifest may hold: a larger one never loads
        required=True,
        metavar="N",
        help=f"shards to write (at most {MAX_SHARDS})",
    )
    reshard.add_argument(
        "--out", type=non_empty_path, required=True, metavar="DIR2", help="the resharded checkpoint"
    )
    reshard.add_argument("--overwrite", action="store_true", help="replace an existing DIR2")
    reshard.set_defaults(handler=_reshard)

    diff = actions.add_parser(
        "diff",
        help="rows added/removed/changed per slot; dense diffs",
        description="What differs between two checkpoints of the same kind (both verified "
        "first): per ID space the rows added, removed and changed and their optimizer state; "
        "the embedding config; per dense tensor of dense.pt the largest difference; the "
        "feature signature; and by checksum jit_dense.pt, opt.pt, scaler.pt and "
        "rng_state.safetensors (the training ranks' random number generators).",
    )
    diff.add_argument("directory_a", type=non_empty_path, metavar="DIR1")
    diff.add_argument("directory_b", type=non_empty_path, metavar="DIR2")
    diff.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=0.0,
        help="a common row counts as changed when some weight moved by more (0: any change)",
    )
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    diff.add_argument(
        "--exit-code",
        action="store_true",
        help="exit 1 when the checkpoints differ (rows, optimizer state, embedding config, "
        "signature, dense tensors, or by checksum jit_dense.pt, opt.pt, scaler.pt)",
    )
    diff.set_defaults(handler=_diff)

    export = actions.add_parser(
        "export-dense",
        help="copy the TorchScript dense model out (loads it to check it: runs its code)",
    )
    export.add_argument("directory", type=non_empty_path, metavar="DIR")
    export.add_argument(
        "--out",
        type=non_empty_path,
        required=True,
        metavar="FILE",
        help="where to write the copy of jit_dense.pt (outside DIR)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing FILE")
    export.set_defaults(handler=_export)


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def _inspect(args: argparse.Namespace) -> int:
    from clients import checkpoint_inspect

    info = checkpoint_inspect.inspect(
        args.directory, load_code=args.load_code, verify_all=args.verify
    )
    if args.json:
        _print_json(info)
    else:
        print(checkpoint_inspect.format_inspect(info))
    # A script that gates on `inspect` must not take a checkpoint with problems for good.
    return 1 if info.get("problems") else 0


def _verify(args: argparse.Namespace) -> int:
    from clients import checkpoint_inspect

    failed = 0
    reports = []
    for directory in args.directories:
        problems, summary = checkpoint_inspect.verify(directory, load_code=args.load_code)
        failed += bool(problems)
        if args.json:
            reports.append({**summary, "ok": not problems, "problems": problems})
        elif problems:
            print(
                f"FAILED: checkpoint {directory}: {len(problems)} problem(s):\n"
                + checkpoint_inspect.iter_problems(problems),
                file=sys.stderr,
            )
        else:
            detail = ", ".join(
                f"{k} {summary[k]}"
                for k in ("version", "dense_files", "embedding_files", "rows", "shards")
                if k in summary
            )
            unloaded = summary.get("jit_model") and not summary.get("code_loaded")
            note = " (jit_dense.pt by checksum; --load-code loads it)" if unloaded else ""
            print(f"OK: checkpoint {directory} ({summary['kind']}): {detail}{note}")
    if args.json:
        _print_json(reports[0] if len(reports) == 1 else reports)
    return 1 if failed else 0


def _reshard(args: argparse.Namespace) -> int:
    from clients import checkpoint_write

    result = checkpoint_write.reshard(
        args.directory, args.shards, args.out, overwrite=args.overwrite
    )
    print(
        f"resharded {args.directory} ({result['from_shards']} shard(s)) -> {result['path']} "
        f"({result['shards']} shards, rows per shard "
        f"{', '.join(str(r) for r in result['rows_per_shard'])}; version {result['version']})"
    )
    return 0


def _diff(args: argparse.Namespace) -> int:
    from clients import checkpoint_diff

    result = checkpoint_diff.diff(args.directory_a, args.directory_b, tolerance=args.tolerance)
    if args.json:
        _print_json(result)
    else:
        print(checkpoint_diff.format_diff(result))
    return 1 if args.exit_code and not result["identical"] else 0


def _export(args: argparse.Namespace) -> int:
    from clients import checkpoint_write

    result = checkpoint_write.export_dense(args.directory, args.out, overwrite=args.overwrite)
    print(
        f"exported {args.directory} (version {result['version']}) dense model -> "
        f"{result['path']} ({result['bytes']} bytes, sha256 {result['sha256']})\n"
        f"forward: {result['forward_signature']}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``eval`` and ``checkpoint`` to ``recserve``."""
    _register_eval(subparsers)
    _register_checkpoint(subparsers)
