"""The one definition of a timing's spread and of "reliable": on fixed sample lists (the decision does not
depend on this machine's speed) and on a real workload timed until steady or capped."""

import os
import subprocess
import sys
import time

import pytest
import torch

from gpuforge.hardware.timing import (
    BUSY,
    NOISY,
    Timing,
    keep_timing,
    said,
    spread_between,
    thread_schedstats,
    time_until_steady,
    unreliable,
)
from gpuforge.plan import StepTiming

STEADY = (1.0, 1.02, 0.98, 1.0) * 4
ONE_STALL = (1.0,) * 15 + (40.0,)  # a neighbour's burst: one run, one window
LOAD_CAME = (1.0,) * 8 + (2.0,) * 8  # the machine got busy halfway through


def test_one_stall_does_not_decide_but_a_load_that_comes_does():
    assert Timing(STEADY).reliable and Timing(STEADY).spread < 0.05
    assert Timing(ONE_STALL).spread == 0 and Timing(ONE_STALL).median_s == 1.0
    noisy = Timing(LOAD_CAME)
    assert noisy.spread > NOISY and not noisy.reliable
    assert unreliable(noisy.spread) == f"unreliable (spread ±{noisy.spread:.0%})"
    assert said(Timing(STEADY).spread) == f"±{Timing(STEADY).spread:.0%}" and said(
        noisy.spread
    ) == unreliable(noisy.spread)


def test_a_steady_timing_on_a_contended_machine_is_unreliable_too():
    # a load that stays all along moves no window: the threads' wait for a CPU says it
    contended = Timing(STEADY, waited=0.45)
    assert contended.spread < NOISY and not contended.reliable
    assert (
        said(contended.spread, 0.45)
        == f"unreliable (spread ±{contended.spread:.0%}, waited for a CPU 45% of the time)"
    )
    assert Timing(STEADY, waited=BUSY).reliable and Timing(STEADY, waited=None).reliable  # None: not known


def test_the_plans_step_timing_is_the_same_definition():
    for times in (STEADY, ONE_STALL, LOAD_CAME):
        steps = StepTiming(times, peak_bytes=0)
        assert (steps.spread, steps.reliable) == (Timing(times).spread, Timing(times).reliable)
    assert "UNRELIABLE" in StepTiming(LOAD_CAME, 0).method()


def test_timing_goes_on_while_noisy_and_stops_at_the_cap():
    rule = {"min_runs": 8, "seconds": 4.0, "max_seconds": 40.0, "max_runs": 1000}
    assert keep_timing(STEADY[:5], **rule)  # too few runs
    assert keep_timing((0.1,) * 10, **rule)  # steady but too short
    assert not keep_timing(STEADY, **rule)  # steady and long enough
    assert keep_timing(LOAD_CAME, **rule)  # long enough but noisy: once more
    assert not keep_timing(LOAD_CAME + (2.0,) * 16, **rule)  # noisy at the cap (40 s): stop, unreliable
    assert not keep_timing((0.01,) * 500 + (0.05,) * 500, **rule)  # noisy at the most runs (1000): stop


def test_a_real_workload_is_timed_at_least_min_runs_and_within_its_cap():
    a = torch.rand(128, 128)
    started = time.perf_counter()
    timing = time_until_steady(lambda: a @ a, min_runs=8, seconds=0.05, max_seconds=0.3)
    spent = time.perf_counter() - started
    assert len(timing.times_s) >= 8 and all(t > 0 for t in timing.times_s)
    # the cap holds on a busy machine too: the timed runs stop once they pass it (one run may overshoot)
    assert sum(timing.times_s) <= 0.3 + max(timing.times_s)
    assert sum(timing.times_s) < spent  # the warm-ups were not counted
    assert timing.reliable == (timing.spread <= NOISY and (timing.waited is None or timing.waited <= BUSY))


def test_the_drift_between_two_timings_of_one_thing_is_the_same_spread():
    before, after = Timing((1.0,) * 8), Timing((3.0,) * 8)
    assert spread_between(before, after) == 0.5  # half of 1..3 over the median 2
    assert spread_between(before, Timing((1.0,) * 8)) == 0


@pytest.mark.skipif(thread_schedstats() is None, reason="no /proc/self/task/*/schedstat on this system")
def test_sharing_a_cpu_with_a_busy_process_is_seen_as_waiting():
    # this process and a spinning one pinned to the same CPU: the scheduler gives each about half of it,
    # however fast the machine, so the timed work is ready to run but waiting much of the time
    cpu, allowed = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the spinner is pinned and running
        timing = time_until_steady(lambda: sum(range(20_000)), seconds=0.3, max_seconds=0.6)
    finally:
        os.sched_setaffinity(0, allowed)
        spinner.kill()
        spinner.wait()
    assert timing.waited is not None and timing.waited > BUSY and not timing.reliable


def test_a_run_of_microseconds_is_timed_in_about_its_cap_not_in_minutes():
    # tens of thousands of runs: asking whether they are steady after each one sorted them all every time
    # (a minute of sorting for a tiny model's latency); it is asked after an eighth more runs now
    started = time.perf_counter()
    timing = time_until_steady(lambda: None, seconds=0.2, max_seconds=0.5)
    spent = time.perf_counter() - started
    assert len(timing.times_s) > 10_000 and sum(timing.times_s) <= 0.5 + max(timing.times_s)
    assert spent < 30  # before: minutes (100 000 runs, each followed by a sort of all of them)
