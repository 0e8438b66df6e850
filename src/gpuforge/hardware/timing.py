"""Timings that say whether to trust them: repeated runs, their median, their spread, and how long this
process waited for a CPU meanwhile.

One definition for every timing gpuforge prints (plan --measure's steps, compress's and export's
latency). The runs, in order, are cut into WINDOWS runs of consecutive ones; the spread is half the range
of the windows' medians, as a fraction of the median of all runs (0.1: ±10 %). A neighbour's burst moves
one window, not all of them, so a single stall does not decide; a load that comes and goes does. A load
that stays all along moves no window, so the kernel is asked too: the share of the time this process's
working threads sat ready to run while other processes held the CPUs (Linux's schedstat run delay). A
figure is reliable when its spread is within NOISY and its threads waited at most BUSY of the time;
otherwise it is shown as unreliable, and nothing is decided on it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WINDOWS = 4
NOISY = 0.15  # window medians further than this (±, of the median) apart: too noisy to trust as it is
BUSY = 0.2  # threads ready to run but waiting for a CPU over this share of the time: a contended machine
MIN_RUNS = 8  # two in each window
SECONDS = 0.5  # timed at least this long
MAX_SECONDS = 2.0  # and while the spread is over NOISY, up to this long: a busy machine is not waited out
LOOK_EVERY = 8  # steady yet? asked after 1/8 more runs (the caps, at every run)


def half_range(medians: Sequence[float], center: float) -> float:
    """Half the range of `medians`, as a fraction of `center`: the spread's one formula."""
    return (max(medians) - min(medians)) / (2 * center) if center > 0 else 0.0


def is_reliable(spread: float, waited: float | None = None) -> bool:
    return spread <= NOISY and (waited is None or waited <= BUSY)


def unreliable(spread: float, waited: float | None = None) -> str:
    """How a table says a figure is not to be trusted, and why."""
    if waited is not None and waited > BUSY:
        return f"unreliable (spread ±{spread:.0%}, waited for a CPU {waited:.0%} of the time)"
    return f"unreliable (spread ±{spread:.0%})"


def said(spread: float, waited: float | None = None) -> str:
    """A figure's trust as a table shows it: its spread, or why it is unreliable."""
    return f"±{spread:.0%}" if is_reliable(spread, waited) else unreliable(spread, waited)


@dataclass(frozen=True)
class Timing:
    """Repeated runs of one thing, timed: the median is the figure; the spread and the wait for a CPU
    say whether to trust it."""

    times_s: tuple[float, ...]  # each run's, in order (warm-ups left out)
    # the working threads' average share of the time spent waiting for a CPU; None: not known here
    waited: float | None = field(default=None, kw_only=True)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def fastest_s(self) -> float:
        return min(self.times_s)

    @property
    def spread(self) -> float:
        size = max(1, len(self.times_s) // WINDOWS)
        windows = [self.times_s[i : i + size] for i in range(0, len(self.times_s) - size + 1, size)]
        return half_range([statistics.median(w) for w in windows], self.median_s)

    @property
    def reliable(self) -> bool:
        return is_reliable(self.spread, self.waited)


def spread_between(*timings: Timing) -> float:
    """The spread of the same thing timed at different moments (each timing a window): how far the
    machine's speed moved between them."""
    medians = [t.median_s for t in timings]
    return half_range(medians, statistics.median(medians))


def keep_timing(
    times_s: Sequence[float], min_runs: int, seconds: float, max_seconds: float, max_runs: int
) -> bool:
    """Whether to run once more: until `min_runs` runs and `seconds` measured, then while the spread is
    over NOISY, until `max_seconds` or `max_runs` (a busy machine may calm down; it is not waited for)."""
    measured = sum(times_s)
    if len(times_s) < min_runs:
        return True
    if len(times_s) >= max_runs or measured >= max_seconds:
        return False
    return measured < seconds or not Timing(tuple(times_s)).reliable


def thread_schedstats() -> dict[str, tuple[int, int]] | None:
    """Each thread of this process: (ns on a CPU, ns ready but waiting for one); None without schedstat."""
    stats = {}
    for path in Path("/proc/self/task").glob("*/schedstat"):
        try:
            on_cpu, waiting = path.read_text().split()[:2]
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
        stats[path.parent.name] = (int(on_cpu), int(waiting))
    return stats or None


def waited_share(before: dict[str, tuple[int, int]] | None, wall_s: float) -> float | None:
    """The average share of `wall_s` that this process's threads which worked since `before` spent
    waiting for a CPU (others held it)."""
    after = thread_schedstats()
    if before is None or after is None or wall_s <= 0:
        return None
    waits = [after[t][1] - before[t][1] for t in after if t in before and after[t][0] > before[t][0]]
    return sum(waits) / 1e9 / wall_s / len(waits) if waits else None


def time_until_steady(
    run: Callable[[], object],
    min_runs: int = MIN_RUNS,
    seconds: float = SECONDS,
    max_seconds: float = MAX_SECONDS,
    max_runs: int = 100_000,
    warmups: int = 2,
) -> Timing:
    """`run` timed after `warmups` untimed calls, as long as keep_timing says (`run` waits for its own
    device: a CUDA caller synchronizes inside it), with the share of the time its threads waited."""
    for _ in range(warmups):
        run()
    times: list[float] = []
    before, started = thread_schedstats(), time.perf_counter()
    measured, next_look = 0.0, 0
    while len(times) < min_runs or (len(times) < max_runs and measured < max_seconds):  # the caps: each run
        # whether the spread is steady yet is asked after an eighth more runs, not after each: a run of
        # microseconds is repeated tens of thousands of times, and each look sorts them all
        if len(times) >= next_look:
            if not keep_timing(times, min_runs, seconds, max_seconds, max_runs):
                break
            next_look = len(times) + max(1, len(times) // LOOK_EVERY)
        start = time.perf_counter()
        run()
        times.append(elapsed := time.perf_counter() - start)
        measured += elapsed
    return Timing(tuple(times), waited=waited_share(before, time.perf_counter() - started))
