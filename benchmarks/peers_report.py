"""The report of benchmarks/peers.py: ``peers.md`` / ``peers.csv`` / ``peers.json``.

Req/s, samples/s, p50/p99 and the ratios recserve / TorchServe (medians over ``--rounds``, and
each round's ratio), whether the goal (recserve >= 2x TorchServe's req/s with a p99 no higher,
unrounded, and no failed request on either side: :func:`goal_met`) is met, the reference
servers' req/s as ratios to TorchServe and to the best recserve variant, and every measurement
with its CPU use and recserve's batching figures.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from peers_measure import Measurement, batch_label, combine_rounds

from load_tests.report import write_atomically


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded for the tables; None unless both were measured (non-zero)."""
    exact = exact_ratio(a, b)
    return None if exact is None else round(exact, 2)


def exact_ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` unrounded (what the goal is judged on); None unless both were measured."""
    return None if not a or not b else a / b


def goal_met(recserve: Measurement, torchserve: Measurement) -> bool:
    """The goal in one cell: recserve at least 2x TorchServe's req/s with a p99 no higher,
    judged on the unrounded ratios (1.996x shows as 2.0 in the table, and is not 2x), and
    only on clean runs: locust counts a failed request in req/s, so a server that fails fast
    looks fast; a failed request or a run without locust stats on either side decides nothing.
    """
    rps = exact_ratio(recserve.rps, torchserve.rps)
    p99 = exact_ratio(recserve.p99_ms, torchserve.p99_ms)
    clean = not any(m.failures or m.error for m in (recserve, torchserve))
    return clean and rps is not None and p99 is not None and rps >= 2 and p99 <= 1


#: The reference servers of benchmarks/ceiling_server.py, as report tables name them.
REFERENCES = {"ceiling": "no-work ceiling", "model-only": "model-only"}


def reference_table(by_key: dict[tuple[str, str, str, str], Measurement]) -> list[str]:
    """Markdown lines comparing each cell's reference servers (``REFERENCES``) with TorchServe
    and with the best recserve variant of the cell (median req/s); none if none was measured."""
    cells = list(dict.fromkeys(
        (m.model, m.batch, m.encoding) for m in by_key.values() if m.server in REFERENCES
    ))  # fmt: skip
    if not cells:
        return []
    measured = [label for label in REFERENCES if any(key[1] == label for key in by_key)]
    header = "| model | batch | encoding |"
    for label in measured:
        name = REFERENCES[label]
        header += f" {name} req/s | {name} / TorchServe | best recserve / {name} |"
    lines = ["", header, "|---|---:|---|" + "---:|---:|---:|" * len(measured)]
    for model, batch, encoding in cells:
        peer = by_key.get((model, "torchserve", batch, encoding))
        best = max(
            (m.rps for m in by_key.values()
             if m.server.startswith("recserve:") and (m.model, m.batch, m.encoding)
             == (model, batch, encoding)),
            default=None,
        )  # fmt: skip
        line = f"| {model} | {batch_label(batch)} | {encoding} |"
        for label in measured:
            reference = by_key.get((model, label, batch, encoding))
            if reference is None:
                line += " - | - | - |"
                continue
            line += (
                f" {reference.rps:.0f} | {ratio(reference.rps, peer.rps if peer else None)} | "
                f"{ratio(best, reference.rps)} |"
            )
        lines.append(line)
    return lines


def report(
    out: Path,
    measurements: list[Measurement],
    variants: dict[str, str],
    info: dict[str, Any],
) -> str:
    """Write ``peers.csv``, ``peers.json`` and ``peers.md`` into ``out`` and return the tables.
    All three are rendered before any is written, and each is written whole (a temporary file,
    then a rename): a rendering that fails, or an interruption, never leaves one file of this
    run beside two of an earlier one, or half a file."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(Measurement.__dataclass_fields__))
    writer.writeheader()
    for m in measurements:
        writer.writerow(m.__dict__)
    # With --rounds, each server of a cell was measured once per round: the tables give the
    # medians, and the ratio of each round's pair shows how far one run can be trusted.
    rounds: dict[tuple[str, str, str, str], list[Measurement]] = {}
    for m in measurements:
        rounds.setdefault((m.model, m.server, m.batch, m.encoding), []).append(m)
    by_key = {key: combine_rounds(runs) for key, runs in rounds.items()}
    lines = [
        "| model | batch | encoding | recserve flags | recserve req/s | TorchServe req/s | "
        "rps ratio | rps ratio per round | recserve p99 ms | TorchServe p99 ms | p99 ratio | "
        "goal (>= 2x, p99 <=) |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    verdicts = []
    for key, m in by_key.items():
        if not m.server.startswith("recserve:"):
            continue
        peer_key = (m.model, "torchserve", m.batch, m.encoding)
        peer = by_key.get(peer_key)
        peer_rounds = {p.round: p for p in rounds.get(peer_key, [])}
        per_round = " / ".join(
            str(ratio(r.rps, peer_rounds[r.round].rps))
            for r in rounds[key]
            if r.round in peer_rounds
        )
        rps_ratio = ratio(m.rps, peer.rps if peer else None)
        p99_ratio = ratio(m.p99_ms, peer.p99_ms if peer else None)
        met = peer is not None and goal_met(m, peer)
        goal = "met" if met else "not met"
        if peer is not None:
            verdicts.append(met)
            if any(x.failures or x.error for x in (m, peer)):
                goal += " (failed requests or no stats)"
        variant = m.server.split(":", 1)[1]
        flags = variants.get(variant) or "(defaults)"
        lines.append(
            f"| {m.model} | {m.batch_label} | {m.encoding} | {variant}: `{flags}` | {m.rps:.0f} | "
            f"{peer.rps if peer else float('nan'):.0f} | {rps_ratio} | {per_round or '-'} | "
            f"{m.p99_ms} | "
            f"{peer.p99_ms if peer else '-'} | {p99_ratio} | {goal} |"
        )
    lines += reference_table(by_key)
    lines += [
        "",
        "| model | batch | encoding | server | round | req/s | samples/s | p50 ms | p99 ms | "
        "failures | server cores | locust cores | merged batch | lookup ms/batch | "
        "compute ms/batch | queue ms/req |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        lines.append(
            f"| {m.model} | {m.batch_label} | {m.encoding} | {m.server} | {m.round} | "
            f"{m.rps:.0f} | "
            f"{m.samples_per_s:.0f} | "
            f"{m.p50_ms} | {m.p99_ms} | {m.failures} | {m.server_cores} | {m.locust_cores} | "
            f"{_dash(m.mean_merged_batch)} | {_dash(m.lookup_ms_per_batch)} | "
            f"{_dash(m.compute_ms_per_batch)} | {_dash(m.queue_ms_per_request)} |"
        )
    summary = "\n".join(lines)
    info["goal_met_everywhere"] = bool(verdicts) and all(verdicts)
    files = {
        "peers.csv": table.getvalue(),
        "peers.json": json.dumps(
            {**info, "measurements": [m.__dict__ for m in measurements]}, indent=2, default=str
        ),
        "peers.md": f"# recserve vs TorchServe\n\n```\n{json.dumps(info, indent=2, default=str)}"
        f"\n```\n\n{summary}\n",
    }
    for name, text in files.items():
        write_atomically(out / name, text)
    return summary


def _dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
