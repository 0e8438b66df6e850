"""Generation throughput of a causal LM through gpuforge's GenerationEngine: torch against its ONNX exports.

    python benchmarks/export_generate.py [--steps 40] [--rounds 2] [--max-tokens 64] [--seconds 2]
                                         [--threads N] [--runs DIR] [--quick] [--json out.json]

The model: examples/gpt-docstrings.yaml (bundled:gpt-tiny, n_layer 4, n_embd 256, n_head 4, byte tokenizer)
trained for `--steps` steps in fp32 with `gpuforge train` into a temporary directory (`--runs DIR` trains
into DIR/gpt, or reuses DIR/gpt/model), then exported with its key/value cache by `gpuforge export MODEL
--format onnx` twice: fp32 into DIR/gpt-onnx and `--quantize int8` into DIR/gpt-int8 (reused when there).

The contenders, each a GenerationEngine from gpuforge.serve.generate.load_engine(device="cpu",
max_batch=16) in a process of its own (spawned; torch.set_num_threads(--threads) before the load, and
onnxruntime takes torch's count), the processes taking turns, one at a time:
  torch-fp32   the model directory, precision fp32
  torch-auto   the model directory, precision "auto" (the pick is printed: bf16 where this CPU's bf16
               matmul is faster, else fp32)
  onnx-fp32    the fp32 export, run by onnxruntime
  onnx-int8    the int8 export (onnxruntime's dynamic quantization)

What is measured: generated tokens per second (engine.tokens' delta over the wall time) at concurrency 1
(4 prompts, one request after another) and 16 (16 prompts submitted together: they share the running
batch), greedy (temperature 0), ignore_eos, `--max-tokens` a request, the set repeated until `--seconds`
have passed. The prompts: the first words of 16 docstring-like lines. Each process warms up once (both
levels) after the load, and runs one short untimed request before each measurement. `--rounds` rounds,
the contenders' order reversed every other round; the figures are the rounds' mean (the range beside it)
and the ratio of the means to torch-fp32's. Agreement: each contender's greedy answers (first round)
against torch-fp32's, prompt by prompt: answers equal, and the fraction of equal tokens (position by
position). onnx-fp32 should match exactly.

No floors: the ratios are printed, with no verdict. `--quick`: one round of 16 new tokens a request, 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.artifact import MANIFEST  # noqa: E402

# name: (the directory under RUNS it runs, its precision)
CONTENDERS = {
    "torch-fp32": ("gpt/model", "fp32"),
    "torch-auto": ("gpt/model", "auto"),
    "onnx-fp32": ("gpt-onnx", "fp32"),
    "onnx-int8": ("gpt-int8", "fp32"),
}
LEVELS = (1, 16)
SERIAL = 4  # requests one after another at concurrency 1
PROMPTS = (  # 16 docstring openings
    "Return the number of|Open the file and|Create a new|Raise an exception if|Convert a string to|"
    "This module provides|Write the data to the|Return True if the|Parse the given|Remove and return an item|"
    "Set the value of|Read up to n bytes|Return a list of all|Close the connection|Encode the object as|"
    "Compute the hash of"
).split("|")


# ---------------------------------------------------------------- the model and its exports


def gpuforge(*args: str, threads: int) -> None:
    """`python -m gpuforge ARGS` in a subprocess, timed; its output shown only when it fails."""
    print("running: gpuforge", " ".join(args), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpuforge", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"gpuforge {args[0]} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)


def prepare(runs: Path, steps: int, threads: int) -> None:
    """RUNS/gpt/model trained, RUNS/gpt-onnx and RUNS/gpt-int8 exported from it (or reused)."""
    model = runs / "gpt" / "model"
    if not (model / MANIFEST).is_file():
        spec = str(ROOT / "examples" / "gpt-docstrings.yaml")
        sets = ("--set", f"train.max_steps={steps}", "--set", "train.precision=fp32")
        gpuforge("train", spec, "--out", str(runs / "gpt"), *sets, threads=threads)
    for out, extra in ((runs / "gpt-onnx", ()), (runs / "gpt-int8", ("--quantize", "int8"))):
        if not (out / "export_report.json").is_file():
            gpuforge("export", str(model), "--format", "onnx", "--out", str(out), *extra, threads=threads)


# ---------------------------------------------------------------- one contender's process


def worker(conn, model_dir: str, precision: str, threads: int) -> None:
    """Loads the engine, warms it up, then answers ("measure", level, max_tokens) with its figures."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    torch.set_num_threads(threads)  # before the load: an onnxruntime session takes this count too
    from gpuforge.serve.generate import SamplingParams, load_engine

    engine = load_engine(model_dir, device="cpu", precision=precision, max_batch=16, max_queue=64)
    engine.start()

    async def one(prompt: str, max_tokens: int) -> tuple[int, ...]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for event in engine.generate(prompt, params):
            if event.finish_reason is not None:
                return event.token_ids
        raise RuntimeError("no final event")

    async def run(level: int, max_tokens: int) -> list[tuple[int, ...]]:
        if level == 1:
            return [await one(p, max_tokens) for p in PROMPTS[:SERIAL]]
        return list(await asyncio.gather(*(one(p, max_tokens) for p in PROMPTS[:level])))

    def measure(level: int, max_tokens: int, min_seconds: float) -> dict:
        asyncio.run(run(1, 4))  # untimed: the process before this one may have left the cores busy
        tokens, steps, start = engine.tokens, engine.steps, time.perf_counter()
        answers, repeats = asyncio.run(run(level, max_tokens)), 1
        while time.perf_counter() - start < min_seconds:
            asyncio.run(run(level, max_tokens))
            repeats += 1
        seconds = time.perf_counter() - start
        tokens, steps = engine.tokens - tokens, engine.steps - steps
        figures = {"tok_per_s": tokens / seconds, "seconds": seconds, "repeats": repeats}
        return figures | {"tokens": tokens, "decode_steps": steps, "answers": answers}

    for level in LEVELS:
        asyncio.run(run(level, 16))
    conn.send({"precision": engine.precision.name, "backend": engine.backend})
    try:
        while (message := conn.recv()) is not None:
            conn.send(measure(*message[1:]))
    finally:
        engine.stop()


def receive(conn, process, within: float = 900):
    if conn.poll(within):
        try:
            return conn.recv()
        except EOFError:
            pass
    raise RuntimeError(f"a worker did not answer (exit code {process.exitcode})")


# ---------------------------------------------------------------- the run


def agreement(answers: list, reference: list) -> dict:
    equal = sum(a == b for a, b in zip(answers, reference, strict=True))
    same = sum(x == y for a, b in zip(answers, reference, strict=True) for x, y in zip(a, b, strict=False))
    total = sum(max(len(a), len(b)) for a, b in zip(answers, reference, strict=True))
    return {"equal_answers": equal, "answers": len(reference), "equal_token_fraction": same / max(total, 1)}


def bench(runs: Path, args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    workers, info = {}, {}
    for name, (where, precision) in CONTENDERS.items():
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=worker, args=(child, str(runs / where), precision, args.threads), daemon=True
        )
        process.start()
        workers[name] = (parent, process)
    rounds = {name: {level: [] for level in LEVELS} for name in CONTENDERS}
    try:
        for name, (conn, process) in workers.items():
            info[name] = receive(conn, process)
            print(f"  {name}: {info[name]['backend']}, precision {info[name]['precision']}", flush=True)
        for r in range(args.rounds):
            order = list(CONTENDERS) if r % 2 == 0 else list(reversed(CONTENDERS))
            for level in LEVELS:
                for name in order:
                    conn, process = workers[name]
                    conn.send(("measure", level, args.max_tokens, args.seconds))
                    row = receive(conn, process)
                    rounds[name][level].append(row)
                    print(
                        f"  round {r + 1}, {name}, concurrency {level}: {row['tok_per_s']:.0f} tok/s",
                        flush=True,
                    )
    finally:
        for conn, _ in workers.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for _, process in workers.values():
            process.join(30)
            if process.is_alive():
                process.kill()
    results = {}
    for name in CONTENDERS:
        results[name] = dict(info[name])
        for level in LEVELS:
            rows = rounds[name][level]
            rates = [row["tok_per_s"] for row in rows]
            reference = rounds["torch-fp32"][level][0]["answers"]
            results[name][level] = {
                "tok_per_s": statistics.fmean(rates),
                "range": [min(rates), max(rates)],
                "rounds": [{k: v for k, v in row.items() if k != "answers"} for row in rows],
                "agreement": agreement(rows[0]["answers"], reference),
            }
    for name in CONTENDERS:
        for level in LEVELS:
            row = results[name][level]
            row["vs_torch_fp32"] = row["tok_per_s"] / results["torch-fp32"][level]["tok_per_s"]
    return results


def print_table(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\ngeneration benchmark: {os.cpu_count()} cores, {args.threads} threads, {args.max_tokens} new "
        f"tokens a request, greedy; mean of {args.rounds} round(s) (range: lowest-highest); "
        "'vs': over torch-fp32's"
    )
    head = "".join(f"{f'c={level} tok/s':>12}{'range':>11}{'vs':>7}" for level in LEVELS)
    print(f"{'contender':<12}{'runs as':<26}{head}  {'same answers (c=1; c=16)':<26}{'same tokens'}")
    for name, row in results.items():
        runs_as = f"{row['backend'].split(' ')[0]} {'int8' if 'int8' in name else row['precision']}"
        cells = ""
        for level in LEVELS:
            low, high = row[level]["range"]
            rate, vs = row[level]["tok_per_s"], row[level]["vs_torch_fp32"]
            cells += f"{rate:>12.0f}{f'{low:.0f}-{high:.0f}':>11}{vs:>6.2f}x"
        same = "; ".join(
            f"{row[lv]['agreement']['equal_answers']}/{row[lv]['agreement']['answers']}" for lv in LEVELS
        )
        tokens = "; ".join(f"{row[lv]['agreement']['equal_token_fraction']:.1%}" for lv in LEVELS)
        print(f"{name:<12}{runs_as:<26}{cells}  {same:<26}{tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (train.max_steps)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the contenders' order alternating")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens a request")
    parser.add_argument("--seconds", type=float, default=2.0, help="at least this long per measurement")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/onnxruntime threads")
    parser.add_argument(
        "--runs", type=Path, help="train and export into (or reuse) DIR/gpt, DIR/gpt-onnx, ..."
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 16 new tokens")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.seconds = 1, 16, 0.5
    with tempfile.TemporaryDirectory(prefix="gpuforge-export-generate-") as tmp:
        runs = args.runs or Path(tmp)
        prepare(runs, args.steps, args.threads)
        results = bench(runs, args)
    print_table(results, args)
    if args.json:
        settings = {"cores": os.cpu_count(), "threads": args.threads, "rounds": args.rounds}
        settings |= {
            "max_tokens": args.max_tokens,
            "seconds": args.seconds,
            "steps": args.steps,
            "levels": list(LEVELS),
        }
        args.json.write_text(json.dumps({**settings, "contenders": results}, indent=2, default=str))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
