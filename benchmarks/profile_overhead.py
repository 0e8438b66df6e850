"""What profiling costs when it is off, and what a profiled step costs when it is on.

    python benchmarks/profile_overhead.py [--calls 1000000] [--steps 60] [--rounds 3]

Off, the engine's phase markers (runtime/phases.py) are `with phase(name):` blocks around each part of a
step: 9 a step with one micro-batch (data wait, forward, backward, sync, optimizer, evaluation, logging,
checkpoint, and the step's own block). Measured two ways, side by side in one run:
  markers   the time of `with phase("forward"): pass` against an empty loop body and against
            `with contextlib.nullcontext(): pass`, over --calls calls: nanoseconds a marker, and what 9 of
            them are of the digits CNN's measured step; and the engine's per-step profile calls with no
            window (Profiling.asked(), which looks for a request file at most once a second, and the
            step's `with profiling.step(n):`), on a main process with a run directory to look in;
  runs      the digits CNN of examples/digits-cnn.yaml (fp32, batch 64) trained --steps steps in this
            process: with no profile, and with train.profile recording 5 steps in the middle. From
            metrics.jsonl, the median step before the window (from step 6) and after it, in both runs (the
            same step numbers), and the recorded steps' mean against them. The two alternate for --rounds
            rounds; medians of the rounds.
The floor (issue 20): profile off costs nothing measurable, i.e. the markers' share of a step is below
0.1 %. A missed floor prints BELOW; the run exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.runtime.phases import phase  # noqa: E402

CNN = ROOT / "examples" / "models" / "digits_cnn.py"
CHANNELS = {"channels": 32}  # as examples/digits-cnn.yaml
MARKERS_A_STEP = 9
FLOOR_SHARE = 0.001


def per_call_ns(body, calls: int) -> float:
    start = time.perf_counter_ns()
    body(calls)
    return (time.perf_counter_ns() - start) / calls


def _empty(n: int) -> None:
    for _ in range(n):
        pass


def _null(n: int) -> None:
    nothing = contextlib.nullcontext()
    for _ in range(n):
        with nothing:
            pass


def _marker(n: int) -> None:
    for _ in range(n):
        with phase("forward"):
            pass


def _per_step(n: int) -> None:
    from gpuforge.train.profile import NO_PROFILE, Profiling

    with tempfile.TemporaryDirectory() as run:
        profiling = Profiling(NO_PROFILE, None, Path(run))
        for step in range(n):
            profiling.asked()
            with profiling.step(step):
                pass


def markers(calls: int) -> dict[str, float]:
    bodies = {"empty": _empty, "nullcontext": _null, "phase": _marker, "step": _per_step}
    rounds = {name: [] for name in bodies}
    for _ in range(5):
        for name, body in bodies.items():
            rounds[name].append(per_call_ns(body, calls))
    best = {name: min(times) for name, times in rounds.items()}
    return {
        "phase_ns": best["phase"] - best["empty"],
        "nullcontext_ns": best["nullcontext"] - best["empty"],
        "step_ns": best["step"] - best["empty"],
    }


def train_once(steps: int, profile: bool, where: Path) -> dict[str, float]:
    from gpuforge.spec import load_spec
    from gpuforge.train.engine import train

    raw = {
        "name": "digits",
        "model": {"source": f"python:{CNN}:build", "task": "image-classification", "options": CHANNELS},
        "data": {"train": "sklearn:digits", "eval_fraction": 0.2},
        "train": {"max_steps": steps, "batch_size": 64, "lr": 3e-3, "precision": "fp32", "log_every": 1},
    }  # fmt: skip
    window = (steps // 2, 5)
    if profile:
        raw["train"]["profile"] = {"start_step": window[0], "steps": window[1]}
    spec = where / "spec.yaml"
    spec.write_text(json.dumps(raw))
    run = where / "run"
    train(load_spec(spec), run)
    times = {
        m["step"]: m["step_time_s"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    }
    before = statistics.median(times[s] for s in range(6, window[0]))
    after = statistics.median(times[s] for s in range(window[0] + window[1] + 1, steps))
    result = {"before_s": before, "after_s": after, "step_s": statistics.median([before, after])}
    if profile:
        report = json.loads((run / "profile" / "profile.json").read_text())
        result["profiled_step_s"] = report["mean_step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    cost = markers(args.calls)
    runs = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            with tempfile.TemporaryDirectory() as where:
                runs[name].append(train_once(args.steps, name == "on", Path(where)))
    median = {name: {k: statistics.median(x[k] for x in rows) for k in ("before_s", "after_s")}
              for name, rows in runs.items()}  # fmt: skip
    step_s = statistics.median(x["step_s"] for x in runs["off"])
    profiled = statistics.median(x["profiled_step_s"] for x in runs["on"])
    share = (cost["phase_ns"] * MARKERS_A_STEP + cost["step_ns"]) * 1e-9 / step_s
    print(
        f"a phase marker, off: {cost['phase_ns']:.0f} ns "
        f"(a bare nullcontext block: {cost['nullcontext_ns']:.0f} ns)"
    )
    print(f"the engine's profile calls a step, no window: {cost['step_ns']:.0f} ns")
    print(
        f"digits CNN step (fp32, batch 64): {step_s * 1000:.2f} ms; "
        f"{MARKERS_A_STEP} markers and the profile calls are {share:.5%} of it"
    )
    for where in ("before_s", "after_s"):
        off, on = median["off"][where], median["on"][where]
        print(
            f"a step {where[:-2]} the window: no profile {off * 1000:.2f} ms, profile asked {on * 1000:.2f} "
            "ms "
            f"(ratio {on / off:.3f}; {args.rounds} rounds, medians)"
        )
    print(f"a recorded step: {profiled * 1000:.2f} ms, {profiled / step_s:.2f}x an unrecorded one")
    verdict = "PASS" if share < FLOOR_SHARE else "BELOW"
    print(f"{verdict}: profile off costs {share:.5%} of a step (floor: under {FLOOR_SHARE:.1%})")


if __name__ == "__main__":
    main()
