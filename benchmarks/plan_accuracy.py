"""Is the plan's step time right? For each shipped example: the step time `gpuforge plan --compare` predicts
on this machine's device, then the step time `gpuforge train` really takes, and the error.

    python benchmarks/plan_accuracy.py                      # this CPU, every example
    python benchmarks/plan_accuracy.py --device cuda        # this machine's GPU (a catalogued model)
    python benchmarks/plan_accuracy.py --steps 40 --json plan_accuracy.json

Two predictions a job:
- **roofline**: from the figures `gpuforge hw` measured here (matmul speed by size and precision, memory
  bandwidth, the cost of one op, and our reference step's share of its roofline), measured once at the
  start (--refresh) as a user's first `gpuforge hw` would; nothing of the job itself is timed;
- **calibrated** (`--measure`): the roofline scaled by a few measured steps of the job.

Then the truth: `gpuforge train SPEC --max-steps N` in its own process, evals and checkpoints pushed past
the end, its summary's median step time (the first, warm-up step is not in it). Floors: median absolute
error under 35% for the roofline and under 10% calibrated. Each job's prediction and its training run are
back to back, so a slow spell on this shared machine moves both. A benchmark: it prints PASS/BELOW and
exits 0 (2 if a run fails).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"roofline": 0.35, "calibrated": 0.10}


def predict(spec: Path, target: str, measure: bool, device: str) -> float:
    cmd = [sys.executable, "-m", "gpuforge", "plan", str(spec), "--compare", target, "--json"]
    cmd += ["--set", f"resources.device_type={device}"]  # the same device as the training run it predicts
    out = subprocess.run(cmd + (["--measure"] if measure else []), capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"plan {spec.name}: {out.stderr.strip()[-400:]}")
    text = out.stdout
    return json.loads(text[text.index("{") :])["targets"][target]["step_s"]


def train(spec: Path, steps: int, device: str) -> float:
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        cmd = [
            sys.executable, "-m", "gpuforge", "train", str(spec), "--out", tmp, "--max-steps", str(steps),
            "--set", f"train.eval_every={steps * 10}", "--set", f"train.checkpoint_every={steps * 10}",
            "--set", f"resources.device_type={device}",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(f"train {spec.name}: {out.stderr.strip()[-400:]}")
        return json.loads((Path(tmp) / "summary.json").read_text())["median_step_s"]


def target_for(device: str) -> str:
    if device == "cpu":
        return "cpu"
    from gpuforge.hardware.catalog import datasheet_for, load_catalog
    from gpuforge.hardware.probe import device_name, select_device

    entry = datasheet_for(load_catalog(), device_name(select_device(device)))
    if entry is None:
        raise SystemExit(
            f"this GPU ({device_name(select_device(device))}) is not in the catalog: nothing to check"
        )
    return entry.key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=50, help="training steps measured per example")
    parser.add_argument("--examples", nargs="*", default=None, help="spec files (default: examples/*.yaml)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    specs = [Path(p) for p in args.examples] if args.examples else sorted((ROOT / "examples").glob("*.yaml"))
    target = target_for(args.device)
    start = time.perf_counter()
    hw = subprocess.run(
        [sys.executable, "-m", "gpuforge", "hw", "--refresh", "--json"], capture_output=True, text=True
    )
    if hw.returncode:
        print(f"FAILED: gpuforge hw: {hw.stderr.strip()[-400:]}")
        return 2
    print(f"gpuforge hw --refresh: {time.perf_counter() - start:.1f} s")
    rows = []
    for spec in specs:
        try:
            roofline = predict(spec, target, False, args.device)
            calibrated = predict(spec, target, True, args.device)
            actual = train(spec, args.steps, args.device)
        except RuntimeError as err:
            print(f"FAILED: {err}")
            return 2
        row = {
            "example": spec.stem,
            "actual_step_s": actual,
            "roofline_step_s": roofline,
            "calibrated_step_s": calibrated,
            "roofline_error": roofline / actual - 1,
            "calibrated_error": calibrated / actual - 1,
        }
        rows.append(row)
        print(
            f"{spec.stem:24s} actual {actual * 1000:8.1f} ms   "
            f"roofline {roofline * 1000:8.1f} ms ({row['roofline_error']:+.0%})   "
            f"calibrated {calibrated * 1000:8.1f} ms ({row['calibrated_error']:+.0%})",
            flush=True,
        )
    result = {"device": args.device, "target": target, "steps": args.steps, "rows": rows}
    for kind, floor in FLOORS.items():
        median = statistics.median(abs(r[f"{kind}_error"]) for r in rows)
        result[f"{kind}_median_abs_error"] = median
        verdict = "PASS" if median < floor else "BELOW"
        print(f"{kind:10s} median |error| {median:.1%} (floor < {floor:.0%}): {verdict}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
