"""Memory: what LoRA and gradient checkpointing save on gpuforge's MiniLM job, each in a process of its own.

    python benchmarks/memory.py                              # the precision gpuforge's `auto` picks
    python benchmarks/memory.py --precision bf16 --json memory.json

The job is train_overhead.py's: all-MiniLM-L6-v2, 4-way sequence classification on
examples/data/topics.jsonl, micro-batch 32, max length 64, AdamW lr 1e-4, seed 0; here 2 warm-up + 8 timed
steps. Each configuration trains in a fresh child process (gpuforge.train.engine.train on a spec file,
as `python -m gpuforge train SPEC --out DIR` runs it), so each peak belongs to one configuration alone:
  full          every parameter trains
  LoRA          LoRA r=8, alpha 16, dropout 0 on the attention query/value projections (the head trains too)
  LoRA+ckpt     the same with train.gradient_checkpointing: activations recomputed in the backward pass

Reported per configuration, from the run directory the child writes:
  peak          summary.json peak_mem_bytes: on a CPU the process's peak RSS (so torch, transformers and
                the model weights are in it; it is read after model/ and the last checkpoint are written),
                on CUDA the allocator's peak
  set-up        the same figure when the loop is about to start: libraries, data, model, optimizer (its
                state is created by the first step); peak - set-up is what training itself added
  samples/s     32 * timed steps / the sum of their step_time_s in metrics.jsonl
  trainable     summary.json trainable_parameters
  opt state     summary.json optimizer_state_bytes (AdamW's two moments per trainable parameter)

This is a benchmark, not a test: it prints PASS/BELOW for the optimizer-state cut and always exits 0
unless a child fails.
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
    "QLoRA-nf4": ({"lora": LORA, "quantize_base": "nf4"}, False),  # needs bitsandbytes ([qlora] extra)
    "QLoRA-int8": ({"lora": LORA, "quantize_base": "int8"}, False),
}
SETUP_FILE = "setup_peak.json"  # written by the child beside the run directory's own files


@dataclass
class Measured:
    peak_mem_bytes: int  # summary.json
    setup_peak_mem_bytes: int  # the same figure just before the first step
    samples_per_s: float  # over the timed steps
    trainable_parameters: int
    optimizer_state_bytes: int
    precision: str
    device_type: str

    @property
    def training_adds_bytes(self) -> int:
        return self.peak_mem_bytes - self.setup_peak_mem_bytes


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


# --------------------------------------------------------------------------- the child process


def child(spec_path: Path, out: Path) -> None:
    """Train the spec as `gpuforge train` does, noting the peak memory when the loop starts."""
    from gpuforge.hardware.probe import peak_memory_bytes, select_device
    from gpuforge.spec import load_spec
    from gpuforge.train.engine import train
    from gpuforge.train.progress import Reporter

    spec = load_spec(spec_path)
    device = select_device(spec.resources.device_type)

    class SetupPeak(Reporter):
        def start(self, total_steps, start_step):  # after set-up, right before step 1
            (out.parent / f"{out.name}.{SETUP_FILE}").write_text(
                json.dumps({"setup_peak_mem_bytes": peak_memory_bytes(device)})
            )

    train(spec, out, SetupPeak())


# --------------------------------------------------------------------------- the parent


def run_config(name: str, precision: str, workdir: Path) -> Measured:
    """Train one configuration in a child process and read what it wrote."""
    spec_path, out = workdir / f"{name}.yaml", workdir / name
    spec_path.write_text(yaml.safe_dump(job_spec(name, precision), sort_keys=False))
    src = str(ROOT / "src")  # this checkout's gpuforge, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(spec_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the child exited {done.returncode}:\n{done.stderr[-3000:]}")

    summary = json.loads((out / "summary.json").read_text())
    setup = json.loads((out.parent / f"{out.name}.{SETUP_FILE}").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    if len(timed) != TIMED_STEPS:
        raise RuntimeError(f"{name}: {len(timed)} timed steps in metrics.jsonl, expected {TIMED_STEPS}")
    return Measured(
        peak_mem_bytes=summary["peak_mem_bytes"],
        setup_peak_mem_bytes=setup["setup_peak_mem_bytes"],
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
    print(
        f"{'config':<12}{'peak MiB':>10}{'set-up MiB':>12}{'train adds':>12}{'samples/s':>11}"
        f"{'trainable':>12}{'opt state MiB':>15}"
    )
    for name, m in results.items():
        print(
            f"{name:<12}{mib(m.peak_mem_bytes):>10}{mib(m.setup_peak_mem_bytes):>12}"
            f"{mib(m.training_adds_bytes):>12}{m.samples_per_s:>11.1f}"
            f"{m.trainable_parameters:>12,}{mib(m.optimizer_state_bytes):>15}"
        )
    print("(train adds: peak - set-up, in MiB)\n")

    checks, ratios = [], {}
    if "full" in results and "LoRA" in results:
        state = results["LoRA"].optimizer_state_bytes / results["full"].optimizer_state_bytes
        cut, floor = 1 - state, MIN_OPTIMIZER_STATE_CUT
        mark = "PASS" if cut > floor else "BELOW"
        print(f"{'opt state LoRA / full':<26}{state:>8.4f}   cut {cut:.1%}   floor {floor:.0%}   {mark}")
        ratios["optimizer_state LoRA / full"] = state
        checks.append({"check": "optimizer state cut", "cut": cut, "floor": floor, "mark": mark})
    for top, bottom in [("LoRA", "full"), ("LoRA+ckpt", "full"), ("LoRA+ckpt", "LoRA")]:
        if top in results and bottom in results:
            a, b = results[top], results[bottom]
            peak, adds = a.peak_mem_bytes / b.peak_mem_bytes, a.training_adds_bytes / b.training_adds_bytes
            print(f"{'peak ' + top + ' / ' + bottom:<26}{peak:>8.3f}   (train adds {adds:.3f})")
            ratios[f"peak {top} / {bottom}"] = peak
            ratios[f"train adds {top} / {bottom}"] = adds
    return {
        "batch_size": BATCH_SIZE,
        "max_length": MAX_LENGTH,
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "results": {
            name: {**asdict(m), "training_adds_bytes": m.training_adds_bytes} for name, m in results.items()
        },
        "ratios": ratios,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision", default="auto", choices=["auto", "fp32", "bf16"], help="train.precision"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="which configurations to run",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]))
        return 0

    results = {}
    with tempfile.TemporaryDirectory(prefix="gpuforge-memory-") as tmp:
        for name in args.configs:
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[name] = run_config(name, args.precision, Path(tmp))
            m = results[name]
            print(
                f"  peak {mib(m.peak_mem_bytes)} MiB, {m.samples_per_s:.1f} samples/s",
                file=sys.stderr,
                flush=True,
            )
    summary = report(results)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
