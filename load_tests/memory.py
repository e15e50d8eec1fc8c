"""The soak's memory verdict: RSS samples of the stack's processes, and the rule judging them.

:class:`RssSampler` samples the RSS of every process of the stack (the server, and in the
remote tier each parameter server and the embedding worker; with ``recserve serve --workers
N``, ``server`` is the supervisor holding the ports and each serving process is ``server.1``
.. ``server.N``), and :func:`memory_verdicts` judges each process on its own by this rule:

* samples of the warm-up (the first 10% of the run, at least min(10 s, 20%)) are left out, and
  so are those of the ``RELOAD_SETTLE_S`` (60 s) after the reload starts: the server loads the
  new model next to the old one, then closes the old one and hands its memory back (a margin
  for a slow load and for the allocator);
* the rest splits into segments (before the reload; after it settled), each judged on its own:
  its growth rate is the Theil-Sen slope (median of the pairwise slopes) of each half of the
  segment, and the *sustained* rate is the smaller of the two halves (a leak grows in both; a
  one-off allocator step of a few MB only in one);
* the *final window* is judged the same way on its own: the judged samples of the last
  ``FINAL_WINDOW_FRACTION`` (20%) of the run, at least ``FINAL_WINDOW_MIN_S`` (60 s), within
  the last segment (the last 2 minutes of a 10-minute soak, ~40 samples at the soak's
  default interval), when it holds at least 12 (6 per half). A leak that starts late (after
  ~8 minutes of 10) grows in only the second half of its segment, which the segment's halves
  let pass; it grows in both halves of the final window. Each half of a 10-minute soak's
  holds ~20 samples over 1 minute: noise of 1 MB (standard deviation) moves its slope by
  ~0.8 MB/min (2 allowed), and a one-off step lies in one half;
* a segment or the final window fails when its sustained rate exceeds
  max(``MAX_GROWTH_MB_PER_MIN`` (1 MB/min), ``GROWTH_FLOOR_MB`` (20 MB) / the soak's
  minutes): 2 MB/min for a 10-minute soak, 40 MB/min for a 30 s one; and the reload fails
  memory when the settled level after it is more than ``GROWTH_FLOOR_MB`` above the level
  before it (an old model never released);
* a soak too short for a judged segment of 6 samples is no verdict: a failure; one whose
  segment after the reload is too short (under ~2 minutes: the 60 s of settling leave too
  little) passes on the segment before it, and its reason says the reload was not judged.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MB = 1024 * 1024
#: The soak's reload when it never happened: the load ended (or a process of the stack died)
#: before half-way.
NO_RELOAD = "never happened: the load ended, or a process of the stack died, before half-way"
#: Seconds after a reload starts whose RSS samples the memory verdict leaves out: both models
#: are resident while the new one loads and warms up; the old one is freed once it is swapped
#: out (serving.service.PredictionService.reload).
RELOAD_SETTLE_S = 60.0
MAX_GROWTH_MB_PER_MIN = 1.0
GROWTH_FLOOR_MB = 20.0
#: The share of the run, at its end, judged as one more window (module docstring): long
#: enough for ~20 samples per half at the soak's default interval (the run / 200).
FINAL_WINDOW_FRACTION = 0.2
#: The final window's least length: halves of 30 s or more (a few seconds of a short soak
#: would judge a transient); in a soak under 5 minutes it is the whole last segment, which
#: the segment rule judges already.
FINAL_WINDOW_MIN_S = 60.0
#: Fewest samples of a judged final window (6 per half).
FINAL_WINDOW_MIN_SAMPLES = 12
#: Samples per half-segment in a Theil-Sen fit (pairs grow as n**2; more add nothing).
_FIT_SAMPLES = 200


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` alone (psutil when installed, else /proc/PID/status): the
    processes of a ``recserve serve --workers N`` server are sampled one by one
    (:func:`load_tests.stack.child_pids`), so that the one that grows is named and each is
    judged on its own."""
    with contextlib.suppress(ImportError):  # without psutil, read /proc below
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Samples the RSS of named PIDs every ``interval`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pids = pids
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.started_at = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while True:
            sample: dict[str, float] = {
                "t_s": round(time.monotonic() - self.started_at, 3),
                "unix": time.time(),
            }
            for name, pid in self.pids.items():
                value = rss_bytes(pid)
                sample[f"{name}_rss_mb"] = round(value / MB, 2) if value is not None else -1.0
            self.samples.append(sample)
            if self._halt.wait(self.interval):
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def theil_sen_slope(times: np.ndarray, values: np.ndarray) -> float | None:
    """Median of the pairwise slopes (value units per time unit); None under 2 samples.

    Robust to outliers and to a step covering less than ~29% of the pairs; at most
    ``_FIT_SAMPLES`` evenly spaced samples are used (the pairs grow as n**2)."""
    times, values = np.asarray(times, np.float64), np.asarray(values, np.float64)
    if len(times) > _FIT_SAMPLES:
        keep = np.linspace(0, len(times) - 1, _FIT_SAMPLES).round().astype(np.int64)
        times, values = times[keep], values[keep]
    first, second = np.triu_indices(len(times), k=1)
    elapsed = times[second] - times[first]
    usable = elapsed > 0
    if not usable.any():
        return None
    return float(np.median((values[second] - values[first])[usable] / elapsed[usable]))


def _sustained_slope(times: np.ndarray, values: np.ndarray) -> float | None:
    """The smaller of the Theil-Sen slopes of the two halves of ``times`` / ``values``
    (float64 [n], seconds and MB): a leak grows in both, a one-off step in one. None when
    neither half has 2 samples at distinct times."""
    half = len(times) // 2
    halves = [
        theil_sen_slope(times[:half], values[:half]),
        theil_sen_slope(times[half:], values[half:]),
    ]
    valid = [h for h in halves if h is not None]
    return min(valid) if valid else None


@dataclass
class MemoryVerdict:
    """The memory verdict of one process (see the module docstring for the rule)."""

    process: str
    samples: int  # judged: after warm-up, outside the reload's settling window
    warmup_s: float
    baseline_mb: float  # median of the first quarter of the judged samples
    last_mb: float  # median of the last quarter
    slope_mb_per_min: float | None  # Theil-Sen over each segment's pairs (for the report)
    sustained_mb_per_min: float | None  # worst smaller-half slope: segments, final window
    final_window_s: float | None  # what the final window spans (None: not judged on its own)
    final_mb_per_min: float | None  # the final window's smaller-half slope
    allowed_mb_per_min: float
    reload_step_mb: float | None  # settled level after the reload minus the level before it
    allowed_step_mb: float
    passed: bool
    reason: str


def memory_verdict(
    times: list[float],
    rss_mb: list[float],
    *,
    warmup_s: float,
    run_s: float,
    reload_s: float | None = None,
    settle_s: float = RELOAD_SETTLE_S,
    max_rate_mb_per_min: float = MAX_GROWTH_MB_PER_MIN,
    floor_mb: float = GROWTH_FLOOR_MB,
    process: str = "server",
) -> MemoryVerdict:
    """Flat memory of one process: RSS samples (``times`` in seconds since sampling began,
    ``rss_mb``; negative = no sample) judged as the module docstring says. ``reload_s``: when
    the reload started, on the same clock; ``run_s``: the soak's length."""
    t = np.asarray(times, np.float64)
    v = np.asarray(rss_mb, np.float64)
    kept = (v >= 0) & (t >= warmup_s)
    if reload_s is None:
        masks = [kept]
    else:
        masks = [kept & (t < reload_s), kept & (t >= reload_s + settle_s)]
    segments = [(t[mask], v[mask]) for mask in masks]
    judged = [(st, sv) for st, sv in segments if len(st) >= 6]
    allowed = max(max_rate_mb_per_min, floor_mb / max(run_s / 60.0, 1e-9))
    values = np.concatenate([sv for _, sv in judged]) if judged else np.zeros(0)
    quarter = max(len(values) // 4, 1)
    baseline = float(np.median(values[:quarter])) if len(values) else 0.0
    last = float(np.median(values[-quarter:])) if len(values) else 0.0

    slopes, sustained = [], []
    for st, sv in judged:
        slopes.append(theil_sen_slope(st, sv))
        rate = _sustained_slope(st, sv)
        if rate is not None:
            sustained.append(rate)
    per_min = [60.0 * x for x in slopes if x is not None]
    slope = round(float(np.median(per_min)), 2) if per_min else None
    worst = round(60.0 * max(sustained), 2) if sustained else None

    # The final window: a late leak grows in the last half of its segment only.
    final_s = final = None
    if judged:
        st, sv = judged[-1]
        late = st >= st[-1] - max(FINAL_WINDOW_FRACTION * run_s, FINAL_WINDOW_MIN_S)
        if late.sum() >= FINAL_WINDOW_MIN_SAMPLES:
            rate = _sustained_slope(st[late], sv[late])
            if rate is not None:
                final_s = round(float(st[late][-1] - st[late][0]), 1)
                final = round(60.0 * rate, 2)

    step = None
    if reload_s is not None and all(len(st) >= 6 for st, _ in segments):
        (_, before), (_, after) = segments
        q_before, q_after = max(len(before) // 4, 2), max(len(after) // 4, 2)
        step = round(float(np.median(after[:q_after]) - np.median(before[-q_before:])), 1)

    if not judged:
        passed, reason = False, f"too few samples after warm-up ({int(kept.sum())})"
    elif worst is not None and worst > allowed:
        passed = False
        reason = f"grows {worst:g} MB/min in both halves of a segment (allowed {allowed:.1f})"
    elif final is not None and final > allowed:
        passed = False
        reason = (
            f"grows {final:g} MB/min in both halves of the final {final_s:g} s (allowed "
            f"{allowed:.1f})"
        )
    elif step is not None and step > floor_mb:
        passed, reason = False, f"{step:g} MB more after the reload settled (allowed {floor_mb:g})"
    elif reload_s is not None and len(segments[1][0]) < 6:
        # Nothing after the reload settled was sampled: a leak the new model brings, or an old
        # model never released, cannot show. A pass, but not one that covers the reload.
        passed = True
        reason = (
            f"flat before the reload; not judged after it (under 6 samples past the {settle_s:g} "
            "s it settles: a longer soak judges it)"
        )
    else:
        passed, reason = True, "flat"
    return MemoryVerdict(
        process=process,
        samples=len(values),
        warmup_s=round(warmup_s, 2),
        baseline_mb=round(baseline, 1),
        last_mb=round(last, 1),
        slope_mb_per_min=slope,
        sustained_mb_per_min=worst if final is None or worst is None else max(worst, final),
        final_window_s=final_s,
        final_mb_per_min=final,
        allowed_mb_per_min=round(allowed, 2),
        reload_step_mb=step,
        allowed_step_mb=floor_mb,
        passed=passed,
        reason=reason,
    )


def memory_verdicts(
    samples: list[dict[str, float]], *, warmup_s: float, run_s: float, reload_s: float | None
) -> dict[str, MemoryVerdict]:
    """:func:`memory_verdict` of every process sampled by :class:`RssSampler` (each
    ``<name>_rss_mb`` column: the server, and the parameter servers and embedding worker of
    the remote tier): any of them growing fails the soak."""
    columns = samples[0] if samples else {}
    names = [key[: -len("_rss_mb")] for key in columns if key.endswith("_rss_mb")]
    times = [s["t_s"] for s in samples]
    return {
        name: memory_verdict(
            times,
            [s[f"{name}_rss_mb"] for s in samples],
            warmup_s=warmup_s,
            run_s=run_s,
            reload_s=reload_s,
            process=name,
        )
        for name in names
    }


def soak_warmup_s(seconds: float) -> float:
    """The warm-up a soak of ``seconds`` leaves out of its memory verdicts: 10% of the run,
    at least min(10 s, 20%)."""
    return max(0.1 * seconds, min(10.0, 0.2 * seconds))


def judge_soak(
    samples: list[dict[str, float]],
    *,
    seconds: float,
    reload_s: float | None,
    reload: dict[str, Any],
) -> tuple[dict[str, MemoryVerdict], list[str]]:
    """A soak's verdicts: :class:`RssSampler`'s ``samples`` judged per process (``reload_s``
    on the sampler's clock, None when the reload never started) and the reload's result
    (:func:`load_tests.checkpoint_reload.soak_reload`); returns the verdicts and what fails
    the soak (:func:`soak_problems`)."""
    verdicts = memory_verdicts(
        samples, warmup_s=soak_warmup_s(seconds), run_s=seconds, reload_s=reload_s
    )
    return verdicts, soak_problems(verdicts, reload)


def verdict_text(problems: list[str], *, soak: bool) -> str:
    """The summary's verdict: every problem, or what passed."""
    return "; ".join(problems) or "no failures" + (", memory flat, reload served" if soak else "")


def soak_problems(verdicts: dict[str, MemoryVerdict], reload: dict[str, Any]) -> list[str]:
    """What fails a soak: each process whose memory is not flat, and a reload that failed,
    never happened, or after which the server does not serve the published version."""
    problems = [
        f"{name} RSS: {verdict.reason}" for name, verdict in verdicts.items() if not verdict.passed
    ]
    if not verdicts:  # no process sampled: nothing says the memory is flat
        problems.append("no RSS samples: the memory was not judged")
    problem = reload_problem(reload)
    if problem is not None:
        problems.append(problem)
    return problems


def reload_problem(reload: dict[str, Any]) -> str | None:
    """Why the soak's reload (:func:`load_tests.checkpoint_reload.soak_reload`'s result)
    fails the soak, in words; None when it passed."""
    if reload.get("ok") is True:
        return None
    published, loaded = reload.get("published"), reload.get("version")
    serves = reload.get("serves")
    if reload.get("error") == NO_RELOAD:
        return f"reload {NO_RELOAD}"
    if "error" in reload:
        return f"reload failed: {reload['error']}"
    if published is not None and loaded != published:
        return (
            f"reload failed: the server loaded version {loaded!r}, not the published {published!r}"
        )
    if isinstance(serves, dict) and "error" in serves:
        return f"reload not verified: asking the server what it serves failed: {serves['error']}"
    if isinstance(serves, dict) and not serves.get("ok"):
        return (
            f"reload not served: after it the model's metadata lists versions "
            f"{serves.get('metadata_versions')} and an inference answered version "
            f"{serves.get('answered_version')!r}, not the published {published!r}"
        )
    return f"reload failed: {reload}"
