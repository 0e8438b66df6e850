"""Automatic batch size against the default micro-batch, at the same global batch, in one run.

    python benchmarks/auto_batch.py [--rounds 2] [--json out.json]

Jobs whose default micro-batch leaves the device mostly idle (small per-step work, many accumulation
steps): the digits CNN and the small GPT on stdlib docstrings. Each runs with `train.batch_size` set to
the default (8) and to `auto` (the largest micro-batch that fits, up to the global batch), the global
batch fixed by `train.global_batch_size`. Timed the same way for both: wall-clock from the end of step
2 to the end of the last step (so the search's own trial steps, before step 1, are not in the window).
Floor: auto >= 1.5 x the default's samples/s, on the job the default leaves mostly idle (the digits
CNN: a few hundred FLOPs per sample). The GPT is context: on a CPU a micro-batch of 8 sequences already
keeps the matrix units busy (see its MFU at the default), so a larger one has little to win; it shows
that the search costs nothing there. On a GPU both jobs are idle at 8 (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.spec import load_spec  # noqa: E402
from gpuforge.train.engine import train  # noqa: E402
from gpuforge.train.progress import Reporter  # noqa: E402

DEFAULT_MICRO = 8
WARMUP_STEPS = 2
FLOOR = 1.5
JOBS = {
    # name: (example spec, global batch, steps, the floor applies)
    "digits-cnn": ("digits-cnn.yaml", 256, 12, True),
    "gpt-docstrings": ("gpt-docstrings.yaml", 64, 6, False),
}


class StepTimes(Reporter):
    def __init__(self):
        self.ends: dict[int, float] = {}

    def step(self, record):
        self.ends[record["step"]] = time.perf_counter()


def run(job: str, micro: str, steps: int) -> dict:
    example, global_batch, _, _ = JOBS[job]
    overrides = [
        f"train.batch_size={micro}",
        f"train.global_batch_size={global_batch}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.checkpoint_every=1000",
        "data.eval_fraction=0.0",
    ]
    spec = load_spec(ROOT / "examples" / example, overrides)
    clock = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        summary = train(spec, Path(out) / "run", clock)
    window = clock.ends[steps] - clock.ends[WARMUP_STEPS]
    return {
        "micro": summary["batch_size"],
        "grad_accum": summary["grad_accum"],
        "samples_per_s": global_batch * (steps - WARMUP_STEPS) / window,
        "peak_mem_gib": summary["peak_mem_bytes"] / 2**30,
        "mfu": summary["mfu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, dict[str, list[dict]]] = {job: {"default": [], "auto": []} for job in JOBS}
    for round_ in range(args.rounds):
        for job, (_, _, steps, _) in JOBS.items():
            for mode, micro in (("default", str(DEFAULT_MICRO)), ("auto", "auto")):
                results[job][mode].append(run(job, micro, steps))
                print(f"round {round_ + 1}: {job} {mode}: {results[job][mode][-1]}", flush=True)

    print(f"\n{'job':<16}{'mode':<9}{'micro x accum':>15}{'samples/s (best)':>18}{'peak GiB':>10}{'MFU':>8}")
    ratios = {}
    for job, modes in results.items():
        best = {mode: max(runs, key=lambda r: r["samples_per_s"]) for mode, runs in modes.items()}
        for mode, r in best.items():
            shape = f"{r['micro']} x {r['grad_accum']}"
            print(
                f"{job:<16}{mode:<9}{shape:>15}{r['samples_per_s']:>18.1f}{r['peak_mem_gib']:>10.2f}"
                f"{r['mfu']:>8.1%}"
            )
        ratios[job] = best["auto"]["samples_per_s"] / best["default"]["samples_per_s"]
    print()
    for job, ratio in ratios.items():
        if JOBS[job][3]:
            verdict = "PASS" if ratio >= FLOOR else "BELOW"
            print(f"ratio auto / default ({job}): {ratio:.2f}   floor {FLOOR}   {verdict}")
        else:
            print(f"ratio auto / default ({job}): {ratio:.2f}   (context, no floor)")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
