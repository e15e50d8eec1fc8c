"""Train the UCI Adult example with recserve's TrainCtx, report test AUC, dump a checkpoint.

Embedded (no services, one process)::

    python examples/adult_income/train.py --checkpoint-dir runs/adult [--overwrite]

Under torchrun with the embedding tier as services (2 DDP ranks, gloo)::

    recserve train --nproc-per-node 2 --embedding-workers 127.0.0.1:7201 \\
        --entry examples/adult_income/train.py -- --checkpoint-dir runs/adult

With data loaders streaming batches (``recserve data-loader --entry
examples/adult_income/data_loader.py ...``) pass ``--streaming``. Prints ``test AUC: 0.9xxx``
and writes ``--metrics-out`` JSON on rank 0.

SIGTERM (a preemption, a pod's deletion, ``kill``; torchrun passes its own on to the ranks)
stops every rank after its current step (under DDP, at the same step within the next 8:
``training.distributed.stop_agreed``) and exits with status 143 (128 + SIGTERM). With
``--checkpoint-on-stop`` the checkpoint is written first, where the run stands (epoch and
batch): ``--resume-from`` goes on from there as the uninterrupted run would have. Without
it nothing is written: deploy/ waits for ``--checkpoint-dir``'s ``DONE`` to serve, and
would serve a partly trained model. ``--stop-checkpoint-dir DIR`` sends that checkpoint to
DIR instead, so ``--checkpoint-dir`` only ever gets a finished run: the same command run
again resumes from DIR, and removes it once it has finished (deploy/k8s/train-job.yaml).
Ctrl-C stops at once, with no checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Run as a script: make the repository root importable (examples.adult_income.*).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from embedding_store.batch import Batch
from embedding_store.checkpoint_manifest import DONE_MARKER
from embedding_store.checkpoint_publish import check_target
from embedding_store.cli_types import non_negative_int, positive_float, positive_int
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import AlreadyExistsError
from examples.adult_income import features
from examples.adult_income.hparams import AdultHParams
from examples.adult_income.metrics import roc_auc
from examples.adult_income.model import AdultDNN
from training import distributed
from training.ctx import TrainCtx, eval_ctx
from training.data import DataLoader, IterableDataset, StreamingDataset

EVAL_BATCH_SIZE = 8192


def evaluate(ctx: TrainCtx, test: features.EncodedRows) -> float:
    """Test AUC with read-only lookups (nothing is inserted, hyperparameters untouched)."""
    scores, labels = [], []
    with eval_ctx(ctx) as evaluator:
        ctx.model.eval()  # the evaluator shares this model (unwrapped from DDP)
        for batch in features.iter_batches(test, EVAL_BATCH_SIZE, requires_grad=True):
            output, batch_labels = evaluator.forward(batch)
            scores.append(output.float().reshape(-1).cpu().numpy())
            labels.append(batch_labels[0].reshape(-1).cpu().numpy())
        ctx.model.train()
    return roc_auc(np.concatenate(labels), np.concatenate(scores))


def local_batches(
    hp: AdultHParams, train: features.EncodedRows, epoch: int, skip: int = 0
) -> Iterator[Batch]:
    """This rank's share of one epoch: batch b goes to rank (b - skip) % world (equal
    counts). ``skip``: the epoch's first batches, already trained (a resumed run's
    ``batches_done``); the rest are dealt out as the uninterrupted run dealt them."""
    rank, world = distributed.rank(), max(distributed.world_size(), 1)
    batches = list(
        range(0, len(train), hp.batch_size)
    )  # batch start offsets, in the shuffled order below
    skip = min(skip, len(batches))
    # Every rank runs the same number of steps (DDP).
    usable = skip + (len(batches) - skip) // world * world
    order = np.random.default_rng(hp.seed * 1000 + epoch).permutation(len(train))
    for b in range(skip + rank, usable, world):
        start = batches[b]
        yield train.take(order[start : start + hp.batch_size]).to_batch(requires_grad=True)


def _count(value: object) -> int:
    """``value`` when it is a whole number > 0 (not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def resume_position(
    saved: dict[str, Any], schedule: dict[str, Any], streaming: bool
) -> tuple[int, int]:
    """Where a resumed run starts: (epoch, batches of that epoch already trained), the
    checkpoint's ``epochs_done`` and ``batches_done`` ((0, 0) when it has none: written by
    another script, or streamed). Says so when the data order will differ from one
    uninterrupted run's (another seed, batch size or number of ranks); with another seed or
    batch size the epoch's batches are other ones, so a stopped epoch starts over."""
    if streaming or saved.get("streaming"):
        return 0, 0  # data loaders decide what comes next
    changed = [
        f"{name} {saved[name]} -> {value}"
        for name, value in schedule.items()
        if name in saved and saved[name] != value
    ]
    if changed and distributed.rank() == 0:
        print(
            "note: resuming with another " + ", ".join(changed) + ": the data order differs "
            "from an uninterrupted run's",
            file=sys.stderr,
        )
    batches_done = _count(saved.get("batches_done"))
    moved = any(
        saved.get(name, schedule[name]) != schedule[name] for name in ("seed", "batch_size")
    )
    if batches_done and moved:
        if distributed.rank() == 0:
            print(
                f"note: the checkpoint stopped {batches_done} batch(es) into an epoch: with "
                "another seed or batch size that epoch starts over",
                file=sys.stderr,
            )
        batches_done = 0
    return _count(saved.get("epochs_done")), batches_done


def build_parser() -> argparse.ArgumentParser:
    """The script's command line (tests/unit/test_deploy_wiring.py parses the deploy files'
    training commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = AdultHParams()
    # Checked here: a batch size of 0 was a traceback from range(), a negative one or a
    # negative epoch count trained nothing and still wrote a checkpoint, a negative seed
    # failed after the data was read.
    parser.add_argument(
        "--epochs",
        type=non_negative_int,
        default=defaults.epochs,
        help="epochs in all: with --resume-from, training goes on from the epochs the "
        "checkpoint has done, in the same data order as one uninterrupted run",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        help="samples per batch; each rank trains one batch per step (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=defaults.seed,
        help="seeds the model, the new embedding rows and the data order (default %(default)s)",
    )
    parser.add_argument(
        "--embedding-staleness",
        type=positive_int,
        default=4,
        help="batches looked up before their embedding gradients are applied (TrainCtx's "
        "embedding_staleness; 1: synchronous; default %(default)s)",
    )
    parser.add_argument(
        "--reproducible", action="store_true", help="staleness 1 and a fixed data order"
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=positive_float,
        default=None,
        metavar="NORM",
        help="clip the dense gradients to this joint L2 norm before each dense step "
        "(TrainCtx's dense_grad_clip_norm; the embedding gradients are not clipped); "
        "without it nothing is clipped",
    )
    parser.add_argument("--streaming", action="store_true", help="batches from data loaders")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="write the trained model's checkpoint here (what recserve serve loads); "
        "without it nothing is written",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an old checkpoint")
    parser.add_argument(
        "--checkpoint-on-stop",
        action="store_true",
        help="on SIGTERM, write --checkpoint-dir where the run stands (epochs and batches "
        "done) before stopping, for --resume-from; without it a SIGTERM stops after the "
        "current step and writes nothing",
    )
    parser.add_argument(
        "--stop-checkpoint-dir",
        type=Path,
        default=None,
        help="with --checkpoint-on-stop: where a SIGTERM's checkpoint goes instead of "
        "--checkpoint-dir, which then only ever receives a finished run (deploy/ serves it); "
        "a run started while this directory holds a checkpoint resumes from it (as "
        "--resume-from would), a stop replaces it, and a run that finishes removes it once "
        "--checkpoint-dir is written: the same command, run again, goes on where it stopped",
    )
    parser.add_argument("--resume-from", type=Path, default=None, help="load this checkpoint")
    parser.add_argument("--eval-only", action="store_true", help="with --resume-from: no training")
    parser.add_argument(
        "--metrics-out",
        type=Path,
        default=None,
        help="write the run's test AUC, steps and settings here as JSON (rank 0)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the dense model's device: cuda is this process's GPU (LOCAL_RANK; DDP then uses "
        "nccl); auto is cuda when CUDA is available, else cpu",
    )
    return parser


def main(argv: list[str] | None = None, *, keep_finished_sigterm: bool = False) -> int:
    """The script. SIGTERM for the whole of it: a stop while training (graceful_sigterm),
    ignored once the run has finished (final checkpoint written, result printed), so that a
    SIGTERM while the process winds down leaves a complete run's exit status 0
    (:func:`training.distributed.sigterm_ignored_once_finished`). ``keep_finished_sigterm``
    (run as a script): a finished run's process ignores SIGTERM after main returns too,
    where an in-process caller gets its own handler back."""
    with distributed.sigterm_ignored_once_finished(keep=keep_finished_sigterm) as run:
        return _main(argv, run)


def _main(argv: list[str] | None, run: distributed.FinishedRun) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and distributed.local_rank() >= torch.cuda.device_count():
        # One GPU per process (cuda:LOCAL_RANK): said by this rank now, not after it joined.
        parser.error(
            f"--device {args.device}: this process (LOCAL_RANK {distributed.local_rank()}) has "
            f"no GPU of its own: this machine has {torch.cuda.device_count()}; start at most "
            "that many processes per node (--nproc-per-node), or pass --device cpu"
        )
    if args.eval_only and args.resume_from is None:
        parser.error("--eval-only needs --resume-from (there is nothing trained to evaluate)")
    if args.checkpoint_on_stop and args.checkpoint_dir is None:
        parser.error("--checkpoint-on-stop needs --checkpoint-dir (where to write it)")
    stop_dir = args.stop_checkpoint_dir
    if stop_dir is not None:
        if not args.checkpoint_on_stop:
            parser.error("--stop-checkpoint-dir needs --checkpoint-on-stop (what writes there)")
        if stop_dir.absolute() == args.checkpoint_dir.absolute():
            parser.error("--stop-checkpoint-dir must differ from --checkpoint-dir")
        try:  # the run's own: a checkpoint there is replaced by a stop, nothing else is
            check_target(stop_dir, overwrite=True)
        except AlreadyExistsError as error:
            parser.error(f"--stop-checkpoint-dir: {error.message}")
        if (stop_dir / DONE_MARKER).is_file():
            if args.resume_from is not None:
                parser.error(
                    f"--resume-from {args.resume_from}: --stop-checkpoint-dir {stop_dir} holds "
                    "a stopped run's checkpoint, which this run would resume from; pass one"
                )
            args.resume_from = stop_dir
    if args.checkpoint_dir is not None:
        # Said now, not after a whole training run that could not be saved.
        try:
            check_target(args.checkpoint_dir, overwrite=args.overwrite)
        except AlreadyExistsError as error:
            parser.error(f"--checkpoint-dir: {error.message}")
        existing = next(p for p in args.checkpoint_dir.absolute().parents if p.exists())
        try:  # the dump stages its files next to the target: try that now
            os.rmdir(tempfile.mkdtemp(prefix=".recserve-probe-", dir=existing))
        except OSError as error:
            parser.error(
                f"--checkpoint-dir {args.checkpoint_dir}: cannot write in {existing} "
                f"({error.strerror or error})"
            )

    hp = AdultHParams(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    torch.manual_seed(hp.seed)
    torch.set_num_threads(hp.torch_threads)  # 1: the MLP's ops are tiny (see AdultHParams)
    config = embedding_config_from_mapping(features.embedding_config_mapping(), source="adult")
    dims = [config.slot(name).dim for name in features.SLOT_NAMES]
    model = AdultDNN(dims, features.NUM_NON_ID_FEATURES, hidden=hp.hidden)
    dense_optimizer = torch.optim.Adam(
        model.parameters(), lr=hp.dense_lr, weight_decay=hp.dense_weight_decay
    )
    staleness = 1 if args.reproducible else args.embedding_staleness
    test = features.read_encoded(features.TEST_PATH)
    # What fixes the data order: a resumed run that differs cannot continue the same schedule.
    schedule = {
        "seed": hp.seed,
        "batch_size": hp.batch_size,
        "world_size": max(distributed.world_size(), 1),
        "streaming": args.streaming,
    }

    started = time.perf_counter()
    with (
        distributed.graceful_sigterm() as stop,
        TrainCtx(
            hp.make_embedding_optimizer(),
            dense_optimizer,
            model,
            embedding_config=config,
            embedding_staleness=staleness,
            initialization=hp.make_initialization(),
            device_id=distributed.local_rank() if use_cuda else None,
            dense_grad_clip_norm=args.clip_grad_norm,
        ) as ctx,
    ):
        first_epoch = first_batch = 0
        if args.resume_from is not None:
            resumed = ctx.load_checkpoint(args.resume_from).train_state
            first_epoch, first_batch = resume_position(resumed, schedule, args.streaming)
            if first_epoch >= hp.epochs and not args.eval_only and distributed.rank() == 0:
                more = f" and {first_batch} batch(es) of the next" if first_batch else ""
                print(
                    f"note: {args.resume_from} has done {first_epoch} epoch(s){more} and "
                    f"--epochs is the total ({hp.epochs}): nothing left to train",
                    file=sys.stderr,
                )
        steps = 0
        # Where this run stands (epoch, batches of it done), so that --resume-from goes on
        # in the same data order: at the end, past the last epoch; without training, where
        # the checkpoint it resumed stood.
        position = (first_epoch, first_batch)
        stopped = False
        if not args.eval_only:
            if args.streaming:
                dataset = StreamingDataset(buffer_size=16, reproducible=args.reproducible)
                for batch in DataLoader(dataset):
                    output, labels = ctx.forward(batch)
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
                    ctx.backward(loss)
                    steps += 1
                    if distributed.stop_agreed(stop):
                        stopped = True
                        break
            else:
                train = features.read_encoded(features.TRAIN_PATH)
                world = max(distributed.world_size(), 1)
                for epoch in range(first_epoch, hp.epochs):
                    skip = first_batch if epoch == first_epoch else 0
                    position = (epoch, skip)
                    source = IterableDataset(
                        functools.partial(local_batches, hp, train, epoch, skip)
                    )
                    for batch in DataLoader(source, prefetch=2):
                        output, labels = ctx.forward(batch)
                        loss = torch.nn.functional.binary_cross_entropy_with_logits(
                            output, labels[0]
                        )
                        ctx.backward(loss)
                        steps += 1
                        position = (epoch, position[1] + world)  # every rank took one batch
                        if distributed.stop_agreed(stop):
                            stopped = True
                            break
                    if stopped:
                        break
            if not stopped and first_epoch < hp.epochs:
                position = (hp.epochs, 0)
        ctx.wait_for_embedding_updates()
        train_seconds = time.perf_counter() - started
        # Stopped: the checkpoint first, within the grace a SIGTERM leaves (torchrun kills
        # its ranks `recserve train --shutdown-timeout` seconds, default 30, after passing it
        # on); the test AUC of a run cut short is not its.
        auc = None if stopped else evaluate(ctx, test)
        manifest = None
        written_to = args.checkpoint_dir
        if stopped and stop_dir is not None:
            written_to = stop_dir
        if written_to is not None and (args.checkpoint_on_stop or not stopped):
            epochs_done, batches_done = position
            manifest = ctx.dump_checkpoint(
                written_to,
                overwrite=args.overwrite or (stop_dir is not None and written_to == stop_dir),
                train_state={**schedule, "epochs_done": epochs_done, "batches_done": batches_done},
            )
        finished = manifest is not None and not stopped and stop_dir is not None
        if finished and distributed.rank() == 0 and (stop_dir / DONE_MARKER).is_file():
            # An earlier stop's checkpoint is spent: left there, the next run of this command
            # would resume from it instead of starting over.
            shutil.rmtree(stop_dir)
            print(f"removed {stop_dir}: the run it stopped has finished", file=sys.stderr)
        if not stopped:
            # graceful_sigterm's handler until the block ends, then main's: a SIGTERM from
            # here on is no stop (the run ends with status 0 all the same).
            run.finish()
        if stopped:
            if distributed.rank() == 0:
                where = f"{position[0]} epoch(s) and {position[1]} batch(es) done"
                if manifest is not None and written_to == stop_dir:
                    saved = (
                        f"checkpoint {stop_dir} (version {manifest.version}) holds them; this "
                        "command, run again, goes on from there"
                    )
                elif manifest is not None:
                    saved = (
                        f"checkpoint {args.checkpoint_dir} (version {manifest.version}) holds "
                        f"them; --resume-from {args.checkpoint_dir} goes on from there (with "
                        f"--overwrite to write the finished run to {args.checkpoint_dir} too)"
                    )
                elif args.checkpoint_dir is not None:
                    saved = (
                        f"nothing written, {args.checkpoint_dir} is as it was "
                        "(--checkpoint-on-stop writes the checkpoint first)"
                    )
                else:
                    saved = "nothing written (no --checkpoint-dir)"
                print(
                    f"stopped by {stop.signal_name} after {steps} step(s) on rank 0 ({where}): "
                    f"{saved}",
                    file=sys.stderr,
                )
        elif distributed.rank() == 0:
            assert auc is not None  # evaluated: not stopped
            print(f"test AUC: {auc:.4f}  ({steps} steps on rank 0, {train_seconds:.1f} s)")
            if manifest is not None:
                print(f"checkpoint: {args.checkpoint_dir} (version {manifest.version})")
            if args.metrics_out is not None:
                args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
                args.metrics_out.write_text(
                    json.dumps(
                        {
                            "test_auc": auc,
                            "steps": steps,
                            "train_seconds": train_seconds,
                            "world_size": distributed.world_size(),
                            "embedding_staleness": staleness,
                            "checkpoint_version": manifest.version if manifest else None,
                            "dense_weight_checksum": float(
                                sum(p.detach().double().sum() for p in ctx.dense_model.parameters())
                            ),
                        }
                    )
                )
    distributed.shutdown_distributed()
    return 128 + int(signal.SIGTERM) if stopped else 0


if __name__ == "__main__":
    sys.exit(main(keep_finished_sigterm=True))
