"""The report of a load run in ``--out``: ``summary.md`` (the CSV's columns less rows),
``summary.csv`` (requests, failures, rps, rows, rows/s, p50, p95, p99 per request name, i.e.
per protocol and batch size, and aggregated), ``summary.json`` (the same rows under
``stats``) and ``latency.png`` (latency percentiles over a trailing ~10 s window and
throughput over time, plus RSS in soak mode).

Each file is written whole or not at all (a temporary file in ``--out``, then a rename): a
reader never sees half a report. ``latency.png`` needs matplotlib, which the ``load`` extra
does not bring; without it the run's verdict and numbers are reported all the same, and the
summary says why there is no plot.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: What the summary says when matplotlib is not importable (see :func:`plot`).
NO_MATPLOTLIB = (
    "latency.png not written: matplotlib is not installed (pip install matplotlib, or the "
    "eval extra: pip install -e '.[eval]')"
)


def write_atomically(path: Path, data: str | bytes) -> None:
    """``data`` into ``path`` whole: a temporary file next to it, then a rename."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(data, bytes):
            temporary.write_bytes(data)
        else:
            temporary.write_text(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def plot(
    path: Path,
    history: list[dict[str, float]],
    *,
    title: str,
    rss: list[dict[str, float]] | None = None,
    marks: Sequence[tuple[float, str]] = (),
    rate_window_s: float = 1.0,
) -> str | None:
    """Latency percentiles and throughput over time (and RSS when given) as a PNG; req/s is
    the history's, over trailing windows of ``rate_window_s`` (see ``read_history``).

    Returns None once ``path`` is written, else why it is not (:data:`NO_MATPLOTLIB`): the
    picture is no part of the run's verdict, so its absence must not cost the summary."""
    try:
        import matplotlib
    except ImportError:
        return NO_MATPLOTLIB

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if rss else 1
    figure, axes = plt.subplots(panels, 1, figsize=(10, 4 * panels), squeeze=False)
    start = history[0]["unix"] if history else (rss[0]["unix"] if rss else 0.0)
    ax = axes[0][0]
    if history:
        t = [row["unix"] - start for row in history]
        for key, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", ":")):
            ax.plot(t, [row[key] for row in history], style, label=key.replace("_ms", ""))
        ax.set_ylabel("latency ms (trailing ~10 s window)")
        steady = [row["p99_ms"] for row in history[len(history) // 10 :] if row["p99_ms"] > 0]
        if steady:  # the start-up window would flatten everything else
            ax.set_ylim(0, max(steady) * 1.3)
        twin = ax.twinx()
        twin.plot(t, [row["rps"] for row in history], color="grey", alpha=0.6, label="req/s")
        twin.set_ylabel(f"requests/s (trailing {rate_window_s:g} s)")
        twin.legend(loc="upper right")
    ax.set_xlabel("seconds")
    ax.set_title(title)
    if history:  # no history (locust failed): nothing to label
        ax.legend(loc="upper left")
    for unix, label in marks:
        for row in axes:
            row[0].axvline(unix - start, color="red", alpha=0.5)
        ax.annotate(label, (unix - start, ax.get_ylim()[1]), color="red", fontsize=8)
    if rss:
        ax2 = axes[1][0]
        for key in [k for k in rss[0] if k.endswith("_rss_mb")]:
            ax2.plot(
                [s["unix"] - start for s in rss], [s[key] for s in rss], label=key[: -len("_mb")]
            )
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("RSS (MB)")
        ax2.legend(loc="upper left")
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    plt.close(figure)
    write_atomically(path, image.getvalue())
    return None


#: What a run writes into ``--out`` besides locust's files: deleted before a run starts, so a
#: reused folder never shows an earlier run's verdict.
REPORT_FILES = ("summary.md", "summary.csv", "summary.json", "latency.png", "rss.csv")


#: The columns of ``summary.csv``: one row per request name (protocol and batch size), then
#: ``Aggregated``; ``rows``: rows sent, ``rows_per_s``: req/s times the batch size.
SUMMARY_COLUMNS = [
    "name", "requests", "failures", "rps", "rows", "rows_per_s", "p50_ms", "p95_ms", "p99_ms"
]  # fmt: skip


def write_summary(out: Path, result: dict[str, Any]) -> None:
    """``summary.csv``, ``summary.json`` and ``summary.md`` of a run's ``result`` (what
    load_tests/run.py gathers; ``result["plot"]``: why ``latency.png`` is missing, if it is).
    All three are rendered before any is written, and each is written whole."""
    rows = result["stats"]
    table = io.StringIO(newline="")
    writer = csv.DictWriter(
        table,
        fieldnames=SUMMARY_COLUMNS,
        extrasaction="ignore",
    )
    writer.writeheader()
    writer.writerows(rows)
    lines = [
        "# recserve load test",
        "",
        f"- model: {result['model']} ({result['inputs']})",
        f"- checkpoint: `{result['checkpoint']}`, tier: {result['tier']}",
        f"- users: {result['users']} ({', '.join(result['classes'])}), "
        f"{result['seconds']:.0f} s, batch mix {result['batches']}, seed {result.get('seed')}",
        f"- serve flags: `{' '.join(result['serve_args']) or '(defaults)'}`",
        _warmup(result.get("warmup")),
        f"- verdict: **{'PASS' if result['passed'] else 'FAIL'}** ({result['verdict']})",
        "- req/s: requests over the time from the start of the load to its last request; "
        "percentiles from locust's histogram of the response times, kept to "
        f"{result.get('latency_resolution') or 'an unknown resolution'}{_ramp(result)}",
        "- each request row is one protocol (route) and batch size (`v2-json b8`: KServe v2 "
        "JSON, 8 rows); rows/s: its req/s times its batch size. **all** mixes them: its req/s "
        "and percentiles are over every request, its rows/s the sum of the rows' rows/s",
        "",
        "| request | requests | failures | req/s | rows/s | p50 ms | p95 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["name"] if row["name"] != "Aggregated" else "**all**"
        per_s = row.get("rows_per_s")
        lines.append(
            f"| {name} | {row['requests']} | {row['failures']} | {row['rps']:.1f} | "
            f"{'-' if per_s is None else f'{per_s:.1f}'} | "
            f"{_ms(row['p50_ms'])} | {_ms(row['p95_ms'])} | {_ms(row['p99_ms'])} |"
        )
    soak = result.get("soak")
    if soak:
        lines += ["", "## Soak", "", f"- reload at {soak['reload_at_s']:.1f} s: {soak['reload']}"]
        pids = soak.get("pids", {})
        for memory in soak["memory"].values():
            step = memory["reload_step_mb"]
            pid = pids.get(memory["process"])
            lines.append(
                f"- {memory['process']}{'' if pid is None else f' (pid {pid})'} RSS: "
                f"{memory['baseline_mb']} MB -> {memory['last_mb']} "
                f"MB, slope {memory['slope_mb_per_min']} MB/min, sustained "
                f"{memory['sustained_mb_per_min']} MB/min (allowed "
                f"{memory['allowed_mb_per_min']}), after the reload "
                f"{'-' if step is None else f'{step:+g} MB'}, {memory['samples']} samples "
                f"after {memory['warmup_s']:.1f} s warm-up: "
                + (
                    ("**flat**" if memory["reason"] == "flat" else f"**flat** ({memory['reason']})")
                    if memory["passed"]
                    else f"**GROWING** ({memory['reason']})"
                )
            )
        lines.append("- series: `rss.csv`")
    plotted = "`latency.png`" if not result.get("plot") else f"none ({result['plot']})"
    lines += ["", f"Latency over time: {plotted}; locust CSVs: `locust_*.csv`.", ""]
    files = {
        "summary.csv": table.getvalue(),
        "summary.json": json.dumps(result, indent=2, default=str),
        "summary.md": "\n".join(lines),
    }
    for name, text in files.items():
        write_atomically(out / name, text)


def _warmup(warmup: dict[str, Any] | None) -> str:
    """The summary's line on the warm-up run before the load (``--warmup-seconds``)."""
    if not warmup:
        return "- warm-up: none (`--warmup-seconds 0`)"
    return (
        f"- warm-up: {warmup['seconds']:.0f} s before the load, {warmup['requests']} requests "
        f"({warmup['failures']} failed), in none of the numbers below (`locust_warmup_*`)"
    )


def _ramp(result: dict[str, Any]) -> str:
    """What the summary's req/s and percentiles include of a ramp-up (``--spawn-rate`` below
    ``--users``: locust starts the users over ~users / rate seconds, and its totals count
    those seconds of fewer users, so req/s reads low)."""
    rate, users = result.get("spawn_rate"), result["users"]
    if rate is None or rate >= users:
        return ""  # all users started at once
    return f"; both include the ramp-up to {users} users at {rate:g}/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
