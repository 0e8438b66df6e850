"""Memory: what LoRA and gradient checkpointing save on gpuforge's MiniLM job, each in a process of its own.

    python benchmarks/memory.py                              # the precision gpuforge's `auto` picks
    python benchmarks/memory.py --precision bf16 --json memory.json

The job is train_overhead.py's: all-MiniLM-L6-v2, 4-way sequence classification on
examples/data/topics.jsonl, micro-batch 32, max length 64, AdamW lr 1e-4, seed 0; here 2 warm-up + 8 timed
steps. Each configuration runs as `python -m gpuforge train SPEC --out DIR` in a fresh child process, so
the peak is that configuration's alone:
  full          every parameter trains
  LoRA          LoRA r=8, alpha 16, dropout 0 on the attention query/value projections (the head trains too)
  LoRA+ckpt     the same with train.gradient_checkpointing: activations recomputed in the backward pass

Reported, from the run directory each child writes:
  peak          summary.json peak_mem_bytes: the process's peak RSS on a CPU (torch, transformers and the
                model included; model/ and the last checkpoint are written before it is read), the
                allocator's peak on CUDA
  train peak    peak_mem_bytes of the last timed step in metrics.jsonl: the same figure before the saves
  samples/s     32 * timed steps / the sum of their step_time_s in metrics.jsonl
  trainable     summary.json trainable_parameters
  opt state     summary.json optimizer_state_bytes (AdamW's two moments per trainable parameter)

This is a benchmark, not a test: it prints PASS/BELOW for the optimizer-state cut but always exits 0
(unless a child fails).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA_FILE = ROOT / "examples" / "data" / "topics.jsonl"

BATCH_SIZE = 32
MAX_LENGTH = 64
LR = 1e-4
SEED = 0
WARMUP_STEPS = 2
TIMED_STEPS = 8
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["query", "value"]}
MIN_OPTIMIZER_STATE_CUT = 0.95  # LoRA must keep less than 5% of the full fine-tune's optimizer state

# name -> (spec `adapt` section, train.gradient_checkpointing)
CONFIGS = {
    "full": ({}, False),
    "LoRA": ({"lora": LORA}, False),
    "LoRA+ckpt": ({"lora": LORA}, True),
}


@dataclass
class Measured:
    peak_mem_bytes: int  # summary.json
    train_peak_mem_bytes: int  # the last timed step's metrics record
    samples_per_s: float  # over the timed steps
    trainable_parameters: int
    optimizer_state_bytes: int
    precision: str
    device_type: str


def job_spec(name: str, precision: str) -> dict:
    adapt, checkpointing = CONFIGS[name]
    return {
        "name": f"memory-{name.lower().replace('+', '-')}",
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": str(DATA_FILE), "max_length": MAX_LENGTH, "eval_fraction": 0.0},
        "adapt": adapt,
        "train": {
            "max_steps": WARMUP_STEPS + TIMED_STEPS,
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "seed": SEED,
            "log_every": 1,  # a metrics record per step
            "precision": precision,
            "warmup_steps": 0,
            "gradient_checkpointing": checkpointing,
        },
    }


def run_config(name: str, precision: str, workdir: Path) -> Measured:
    """Train one configuration in a child process and read what it wrote."""
    spec_path, out = workdir / f"{name}.yaml", workdir / name
    spec_path.write_text(yaml.safe_dump(job_spec(name, precision), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "gpuforge", "train", str(spec_path), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: gpuforge train exited {done.returncode}:\n{done.stderr[-3000:]}")

    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    if len(timed) != TIMED_STEPS:
        raise RuntimeError(f"{name}: {len(timed)} timed steps in metrics.jsonl, expected {TIMED_STEPS}")
    return Measured(
        peak_mem_bytes=summary["peak_mem_bytes"],
        train_peak_mem_bytes=timed[-1]["peak_mem_bytes"],
        samples_per_s=BATCH_SIZE * len(timed) / sum(r["step_time_s"] for r in timed),
        trainable_parameters=summary["trainable_parameters"],
        optimizer_state_bytes=summary["optimizer_state_bytes"],
        precision=summary["precision"],
        device_type=summary["device_type"],
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(results: dict[str, Measured]) -> dict:
    first = next(iter(results.values()))
    print(
        f"\njob: all-MiniLM-L6-v2 seq-cls, batch {BATCH_SIZE}, max_length {MAX_LENGTH}, "
        f"{WARMUP_STEPS} warm-up + {TIMED_STEPS} timed steps, {first.device_type} {first.precision}, "
        "one process per configuration\n"
    )
    print(f"{'config':<12}{'peak MiB':>10}{'train peak':>12}{'samples/s':>11}{'trainable':>12}{'opt state MiB':>15}")
    for name, m in results.items():
        print(
            f"{name:<12}{mib(m.peak_mem_bytes):>10}{mib(m.train_peak_mem_bytes):>12}{m.samples_per_s:>11.1f}"
            f"{m.trainable_parameters:>12,}{mib(m.optimizer_state_bytes):>15}"
        )
    print("(peak: summary.json, after model/ and the checkpoint are written; train peak: at the last step)")

    print()
    checks, ratios = [], {}
    if "full" in results and "LoRA" in results:
        full, lora = results["full"], results["LoRA"]
        state = lora.optimizer_state_bytes / full.optimizer_state_bytes
        mark = "PASS" if 1 - state > MIN_OPTIMIZER_STATE_CUT else "BELOW"
        print(
            f"{'opt state LoRA / full':<28}{state:>8.4f}   cut {1 - state:.1%}   "
            f"floor {MIN_OPTIMIZER_STATE_CUT:.0%}   {mark}"
        )
        checks.append({"check": "optimizer_state_cut", "value": 1 - state, "floor": MIN_OPTIMIZER_STATE_CUT, "mark": mark})
        ratios["optimizer_state_lora_over_full"] = state
    for top, bottom in [("LoRA", "full"), ("LoRA+ckpt", "full"), ("LoRA+ckpt", "LoRA")]:
        if top in results and bottom in results:
            for key, label in [("peak_mem_bytes", "peak"), ("train_peak_mem_bytes", "train peak")]:
                value = getattr(results[top], key) / getattr(results[bottom], key)
                print(f"{label + ' ' + top + ' / ' + bottom:<28}{value:>8.3f}")
                ratios[f"{key}_{top}_over_{bottom}"] = value
    return {
        "batch_size": BATCH_SIZE,
        "max_length": MAX_LENGTH,
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "results": {name: asdict(m) for name, m in results.items()},
        "ratios": ratios,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="train.precision")
    parser.add_argument(
        "--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="which configurations to run"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)

    results = {}
    with tempfile.TemporaryDirectory(prefix="gpuforge-memory-") as tmp:
        for name in args.configs:
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[name] = run_config(name, args.precision, Path(tmp))
            m = results[name]
            print(f"  peak {mib(m.peak_mem_bytes)} MiB, {m.samples_per_s:.1f} samples/s", file=sys.stderr, flush=True)
    summary = report(results)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
