"""ONNX exports against the torch model they came from: latency, throughput, served req/s and accuracy.

    python benchmarks/export.py [--models minilm,digits] [--seconds 10] [--warmup 2] [--rounds 2]
                                [--threads N] [--latency-seconds 8] [--runs DIR] [--quick] [--json out.json]

The models: the MiniLM topic classifier of examples/minilm-topics.yaml (1 epoch, fp32) and the digits CNN
of examples/digits-cnn.yaml (60 steps, fp32), each trained with `gpuforge train` into a temporary
directory (`--runs DIR` trains into DIR/<model>, or reuses what is there). Each is exported twice with
`gpuforge export MODEL --format onnx`: fp32, and `--quantize int8` (onnxruntime's dynamic quantization).

The contenders, per model:
  torch-fp32   the model directory, fp32                      (gpuforge serve --precision fp32)
  torch-bf16   the model directory under bf16 autocast        (gpuforge serve --precision auto: the pick
               is read from GET /info and printed; it is bf16 where this CPU's bf16 matmul is faster)
  onnx-fp32    the fp32 export, run by onnxruntime            (gpuforge serve EXPORT)
  onnx-int8    the int8 export, run by onnxruntime            (gpuforge serve EXPORT)

What is measured, for each contender:
  no server    a forward pass of the model as gpuforge.artifact.load_artifact loads it (an export: behind
               onnxruntime), under torch.inference_mode, on the first 1 and 32 rows of the run's held-out
               split (text padded per batch), each contender in a process of its own (as behind a
               server: torch's and onnxruntime's thread pools in one process slow each other). They
               take turns of 0.3 s for `--latency-seconds` per batch size after a warm-up; the median
               call is the latency, and 32 / the batch-32 median the throughput (samples/s).
  served       `gpuforge serve DIR --max-batch 32 --max-wait-ms 5` on 127.0.0.1, one server at a time,
               32 clients in closed loop, one input per request (the sentences of
               examples/data/topics.jsonl; for the CNN the 1,797 scikit-learn digits scaled to 0..1 as
               1 x 8 x 8 nested lists), in benchmarks/serve_load.py's load generator (its own process,
               sharing the cores with the server: its CPU and the rest of the machine's are shown).
               `--warmup` seconds, then `--seconds` measured: req/s of the 200s, p50/p99, mean batch.
               `--rounds` rounds, the order reversed every other one; the figures are the rounds' mean
               (the req/s range beside it), the ratios ("vs") of those means.
  accuracy     on the run's held-out split: the ONNX contenders' from the export's export_report.json,
               the torch ones' computed the same way (tasks.forward and EvalTally over batches of 32).
Torch uses `--threads` (OMP_NUM_THREADS for each server, torch.set_num_threads here; default: this
machine's cores); onnxruntime takes the same count.

Floors (issue 19), MiniLM classifier, 32 clients:
  onnx-int8 served req/s >= 2.5x torch-fp32 served, and >= 1.3x torch-bf16 (auto) served;
  onnx-int8 accuracy within 1 point of torch-fp32's.
The digits CNN gets the same ratios printed, without floors. A floor missed is BELOW; the run exits 0.
`--quick`: one round of 3 s windows after 1 s of warm-up, 2 s of latency rounds: a smoke run. Every server is
stopped at the end, on an error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import MAX_QUEUE, Server, fmt_statuses, run_level, sentences, train  # noqa: E402

from gpuforge.artifact import MANIFEST, built_from, load_artifact  # noqa: E402
from gpuforge.artifact.origin import open_source  # noqa: E402
from gpuforge.data.batches import micro_batches  # noqa: E402
from gpuforge.runtime import tasks  # noqa: E402
from gpuforge.runtime.precision import Precision, autocast  # noqa: E402

MODELS = {
    "minilm": ("minilm-topics.yaml", ("--set", "train.epochs=1", "--set", "train.precision=fp32")),
    "digits": ("digits-cnn.yaml", ("--max-steps", "60", "--set", "train.precision=fp32")),
}
TITLES = {"minilm": "MiniLM topic classifier", "digits": "digits CNN"}
# name: (the directory it runs, its no-server precision, its `gpuforge serve --precision`)
CONTENDERS = {
    "torch-fp32": ("model", "fp32", "fp32"),
    "torch-bf16": ("model", "bf16", "auto"),
    "onnx-fp32": ("onnx-fp32", "fp32", "fp32"),
    "onnx-int8": ("onnx-int8", "fp32", "fp32"),
}
CLIENTS = 32
BATCHES = (1, 32)
TURN_S = 0.3  # a contender's turn at the no-server calls
FLOOR_VS_FP32, FLOOR_VS_AUTO, MAX_METRIC_POINTS = 2.5, 1.3, 1.0  # issue 19, MiniLM only
FLOORED = ("minilm",)
CPU = torch.device("cpu")


# ---------------------------------------------------------------- the model and its exports


def prepare(key: str, runs: Path, threads: int) -> dict[str, Path]:
    """The trained model/ directory and its two exports, made (or reused) under runs/<key>."""
    base = runs / key
    spec, options = MODELS[key]
    model = base / "model"
    if not (model / MANIFEST).is_file():
        train(ROOT / "examples" / spec, base, *options)
    dirs = {"model": model}
    for quantize in ("fp32", "int8"):
        out = base / f"onnx-{quantize}"
        if not (out / "export_report.json").is_file():  # a reused --runs keeps its exports
            export(model, out, quantize, threads)
        dirs[out.name] = out
    return dirs


def export(model: Path, out: Path, quantize: str, threads: int) -> None:
    command = [sys.executable, "-m", "gpuforge", "export", str(model), "--format", "onnx", "--out", str(out)]
    if quantize == "int8":
        command += ["--quantize", "int8"]
    print("exporting:", " ".join(command[3:]), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **threads_env(threads)})
    if done.returncode != 0:
        raise RuntimeError(f"the export failed:\n{(done.stdout + done.stderr)[-3000:]}")
    print(f"  exported in {time.perf_counter() - started:.0f} s", flush=True)


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def request_inputs(key: str) -> list:
    """What the clients send, one per request: sentences, or digits as 1 x 8 x 8 lists in 0..1."""
    if key == "minilm":
        return sentences()
    from sklearn.datasets import load_digits

    images = load_digits().images / 16.0  # as gpuforge's sklearn:digits source scales them
    return [[image.tolist()] for image in images]


# ---------------------------------------------------------------- no server: latency, throughput, accuracy
# Each contender runs in a process of its own, as it does behind `gpuforge serve`: in one process, torch's
# OpenMP threads and onnxruntime's spinning pool take each other's cores (measured: torch's batch-1 call
# 2.7x slower when its calls alternate with onnxruntime's there). The processes take turns, one at a time.


def cast_for(precision: str):
    """bf16 through gpuforge's own autocast (as `gpuforge serve` runs it), else nothing."""
    return autocast(Precision(precision, "benchmark"), CPU)


def accuracy(built, task: str, data, precision: str) -> float:
    """The held-out accuracy as export/parity.py measures it, under `precision`."""
    tally = tasks.EvalTally(task)
    with torch.inference_mode(), cast_for(precision):
        for chunk in micro_batches(list(range(len(data))), 32):
            batch = data.collate(chunk)
            tally.add(tasks.forward(built, task, batch).float(), batch)
    return tally.result()["accuracy"]


def forward_worker(conn, run_model_dir: str, model_dir: str, precision: str, threads: int) -> None:
    """One contender's model in this process; answers ("time", n, seconds) with its calls' ms at batch n
    (one untimed call first: the pool of the process before it may still spin) and ("accuracy",)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    torch.set_num_threads(threads)  # before the load: an onnxruntime session takes this count too
    source = open_source(run_model_dir)  # the export's own directory has no run spec beside it
    task, data = source.spec.model.task, source.data.eval
    module, _, manifest = load_artifact(model_dir, "cpu")
    built = built_from(module.eval(), manifest)
    batches = {n: data.collate([i % len(data) for i in range(n)]) for n in BATCHES}

    def call(n: int) -> float:
        with torch.inference_mode(), cast_for(precision):
            start = time.perf_counter()
            tasks.forward(built, task, batches[n])
            return 1000 * (time.perf_counter() - start)

    for n in BATCHES:
        for _ in range(3):  # first calls allocate and pick kernels
            call(n)
    conn.send(("ready", len(data)))
    while (message := conn.recv()) is not None:
        if message[0] == "accuracy":
            conn.send(accuracy(built, task, data, precision))
            continue
        _, n, seconds = message
        call(n)
        times, deadline = [], time.perf_counter() + seconds
        while len(times) < 3 or time.perf_counter() < deadline:
            times.append(call(n))
        conn.send(times)


def start_workers(dirs: dict[str, Path], threads: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    workers = {}
    for name, (where, precision, _) in CONTENDERS.items():
        parent, child = ctx.Pipe()
        args = (child, str(dirs["model"]), str(dirs[where]), precision, threads)
        process = ctx.Process(target=forward_worker, args=args, daemon=True)
        process.start()
        workers[name] = (process, parent)
    return workers


def ask(worker, message: tuple, within: float = 600):
    worker[1].send(message)
    return receive(worker, within)


def receive(worker, within: float = 600):
    process, conn = worker
    if not conn.poll(within):
        raise RuntimeError("a no-server worker did not answer")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"a no-server worker exited (code {process.exitcode})") from None


def stop_workers(workers: dict) -> None:
    for _, conn in workers.values():
        with contextlib.suppress(OSError):
            conn.send(None)
    for process, _ in workers.values():
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)


def no_server(dirs: dict[str, Path], seconds: float, threads: int) -> tuple[dict, dict]:
    """Median call (ms) at each batch size and batch-32 samples/s of every contender, their turns
    alternating for `seconds` per batch size; the accuracies (the exports': their report's)."""
    workers = start_workers(dirs, threads)
    try:
        ready = [receive(worker) for worker in workers.values()]  # each: ("ready", held-out examples)
        figures: dict[str, dict[str, float]] = {name: {} for name in workers}
        names = list(workers)
        for n in BATCHES:
            times: dict[str, list[float]] = {name: [] for name in names}
            deadline, turn = time.perf_counter() + seconds, 0
            while turn < 2 * len(names) or time.perf_counter() < deadline:
                name = names[turn % len(names)]
                times[name] += ask(workers[name], ("time", n, TURN_S))
                turn += 1
            for name in names:
                figures[name][f"batch_{n}_ms"] = statistics.median(times[name])
                figures[name][f"batch_{n}_calls"] = len(times[name])
        for row in figures.values():
            row["samples_per_s"] = BATCHES[-1] * 1000 / row[f"batch_{BATCHES[-1]}_ms"]
        metrics = {"examples": ready[0][1]}
        for name in ("torch-fp32", "torch-bf16"):
            metrics[name] = ask(workers[name], ("accuracy",))
    finally:
        stop_workers(workers)
    for name in ("onnx-fp32", "onnx-int8"):
        report = json.loads((dirs[name] / "export_report.json").read_text())["metric"]
        metrics[name] = report["onnx"]
        if report["torch"] != metrics["torch-fp32"]:  # the export measured torch on another split?
            print(f"  note: {name}'s report has torch-fp32 at {report['torch']:.4f}", flush=True)
    return figures, metrics


# ---------------------------------------------------------------- served


def make_server(name: str, model_dir: Path, precision: str, threads: int, logs: Path) -> Server:
    command = [sys.executable, "-m", "gpuforge", "serve", str(model_dir), "--precision", precision]
    command += ["--max-batch", "32", "--max-wait-ms", "5", "--max-queue", str(MAX_QUEUE)]
    # the name starts with gpuforge: serve_load then reads the batch sizes from /metrics
    return Server(f"gpuforge-{name}", command, "/readyz", threads_env(threads), logs / f"{name}.log")


def serve_once(name: str, model_dir: Path, precision: str, inputs: list, args, logs: Path) -> dict:
    """One server, 32 closed-loop clients: serve_load's row, with what /info says it runs."""
    server = make_server(name, model_dir, precision, args.threads, logs)
    try:
        server.start()
        info = httpx.get(server.url + "/info", timeout=5).json()
        row = run_level(server, CLIENTS, args.warmup, args.seconds, inputs)
    finally:
        server.stop()
    # an int8 export's /info says precision fp32 (the graph's float parts) and quantized int8
    row.update(precision=info["precision"], quantized=info.get("quantized"), backend=info["backend"])
    return row


def served(dirs: dict[str, Path], inputs: list, args: argparse.Namespace, logs: Path) -> dict[str, dict]:
    """One server at a time, in `--rounds` rounds, the order reversed every other round (a neighbour that
    comes or goes mid-run weighs on every contender alike); per contender, the mean over its rounds."""
    rounds: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        order = list(CONTENDERS) if r % 2 == 0 else list(reversed(CONTENDERS))
        for name in order:
            where, _, precision = CONTENDERS[name]
            row = serve_once(name, dirs[where], precision, inputs, args, logs)
            rounds[name].append(row)
            print(
                f"  round {r + 1}, {name}: {row['req_per_s']:.1f} req/s, "
                f"{fmt_statuses(row['statuses'])}, other CPU {row['other_cpu']:.2f} cores",
                flush=True,
            )
    return {name: mean_row(rows) for name, rows in rounds.items()}


def mean_row(rows: list[dict]) -> dict:
    """The numbers averaged over rounds, the rest from the first; every round kept under "rounds"."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.fmean(r.get(key, value) for r in rows)
    out["statuses"] = dict(sum((Counter(r["statuses"]) for r in rows), Counter()))
    out["req_per_s_range"] = [min(r["req_per_s"] for r in rows), max(r["req_per_s"] for r in rows)]
    out["rounds"] = rows
    return out


# ---------------------------------------------------------------- report


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def print_model(key: str, result: dict) -> None:
    fwd, serve, metric = result["no_server"], result["served"], result["metrics"]
    print(f"\n{key}: {TITLES[key]}, accuracy on {metric['examples']} held-out examples")
    print(
        f"{'':<12}{'no server':^24}{'served, 32 clients':^40}\n"
        f"{'contender':<12}{'b1 ms':>8}{'b32 ms':>8}{'b32 /s':>8}{'req/s':>8}{'range':>10}{'p50':>6}"
        f"{'p99':>6}{'batch':>6}  {'vs fp32':>7}{'vs bf16':>8}{'accuracy':>10}"
        "  served as; CPU server/loadgen/other"
    )
    fp32, auto = serve["torch-fp32"]["req_per_s"], serve["torch-bf16"]["req_per_s"]
    for name in CONTENDERS:
        f, s = fwd[name], serve[name]
        low, high = s["req_per_s_range"]
        runs_as = f"{s['backend'].split(' ')[0]} {s['quantized'] or s['precision']}"
        cpu = f"{s['server_cpu']:.2f}/{s['loadgen_cpu']:.2f}/{s['other_cpu']:.2f}"
        print(
            f"{name:<12}{f['batch_1_ms']:>8.2f}{f['batch_32_ms']:>8.1f}{f['samples_per_s']:>8.0f}"
            f"{s['req_per_s']:>8.1f}{f'{low:.0f}-{high:.0f}':>10}{s['p50_ms']:>6.0f}{s['p99_ms']:>6.0f}"
            f"{s.get('mean_batch', 0):>6.1f}  {ratio(s['req_per_s'], fp32):>6.2f}x"
            f"{ratio(s['req_per_s'], auto):>7.2f}x{metric[name]:>10.4f}  {runs_as}; {cpu}"
        )
    nf, nb = fwd["torch-fp32"]["samples_per_s"], fwd["torch-bf16"]["samples_per_s"]
    int8 = fwd["onnx-int8"]["samples_per_s"]
    print(
        f"no server, batch 32 samples/s: onnx-int8 = {ratio(int8, nf):.2f}x torch-fp32, "
        f"{ratio(int8, nb):.2f}x torch-bf16 (the models alone: no HTTP, batching or load generator)"
    )


def verdicts(key: str, result: dict) -> list[dict]:
    """The issue's three checks on onnx-int8; PASS/BELOW for a floored model, else '-' (printed only)."""
    serve, metric = result["served"], result["metrics"]
    int8 = serve["onnx-int8"]["req_per_s"]
    vs_fp32 = ratio(int8, serve["torch-fp32"]["req_per_s"])
    vs_auto = ratio(int8, serve["torch-bf16"]["req_per_s"])
    points = 100 * (metric["onnx-int8"] - metric["torch-fp32"])
    checks = [  # what, value, floor, met (a NaN ratio meets nothing)
        ("served req/s vs torch-fp32", vs_fp32, FLOOR_VS_FP32, vs_fp32 >= FLOOR_VS_FP32),
        ("served req/s vs torch-bf16 (auto)", vs_auto, FLOOR_VS_AUTO, vs_auto >= FLOOR_VS_AUTO),
        ("accuracy vs torch-fp32", points, MAX_METRIC_POINTS, abs(points) <= MAX_METRIC_POINTS),
    ]
    verdict = {True: "PASS", False: "BELOW"} if key in FLOORED else {True: "-", False: "-"}
    return [
        {"model": key, "what": what, "value": value, "floor": floor, "verdict": verdict[met]}
        for what, value, floor, met in checks
    ]


def print_verdicts(judged: list[dict]) -> None:
    print("\nfloors (issue 19; onnx-int8 at 32 clients; '-': printed, no floor for this model):")
    for v in judged:
        points = v["what"].startswith("accuracy")
        shown = f"{v['value']:+.2f} points" if points else f"{v['value']:.2f}x"
        floor = f"within {v['floor']:g} point" if points else f">= {v['floor']:g}x"
        print(f"  {v['verdict']:<6}{v['model']:<8}onnx-int8 {v['what']}: {shown}  (floor {floor})")


# ---------------------------------------------------------------- the run


def run_model(key: str, runs: Path, args: argparse.Namespace) -> dict:
    print(f"\n== {key}", flush=True)
    dirs = prepare(key, runs, args.threads)
    print("  no-server rounds ...", flush=True)
    figures, metrics = no_server(dirs, args.latency_seconds, args.threads)
    rows = served(dirs, request_inputs(key), args, runs / key)
    paths = {k: str(v) for k, v in dirs.items()}
    return {"dirs": paths, "no_server": figures, "served": rows, "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: minilm, digits")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per server")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    parser.add_argument("--latency-seconds", type=float, default=8.0, help="no-server rounds per batch size")
    parser.add_argument("--rounds", type=int, default=2, help="windows per server, in alternating order")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/onnxruntime threads")
    parser.add_argument("--runs", type=Path, help="train and export into (or reuse) DIR/<model>")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short windows")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    if set(keys) - set(MODELS):
        parser.error(f"--models: unknown {', '.join(sorted(set(keys) - set(MODELS)))}")
    if args.quick:
        args.seconds, args.warmup, args.latency_seconds, args.rounds = 3.0, 1.0, 2.0, 1
    torch.set_num_threads(args.threads)  # before any load: onnxruntime sessions take this count too

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill also goes through the `finally`s
    with tempfile.TemporaryDirectory(prefix="gpuforge-export-bench-") as tmp:
        runs = args.runs or Path(tmp)
        results = {key: run_model(key, runs, args) for key in keys}

    print(
        f"\nexport benchmark: {os.cpu_count()} cores, {args.threads} threads; served: {CLIENTS} clients, "
        f"{args.seconds:g} s after {args.warmup:g} s warm-up, mean of {args.rounds} round(s) (range: "
        "lowest-highest); no server: medians over "
        f"{args.latency_seconds:g} s of alternating rounds; 'vs': served req/s over torch-fp32's / "
        "torch-bf16 (auto)'s"
    )
    judged = []
    for key, result in results.items():
        print_model(key, result)
        judged += verdicts(key, result)
    print_verdicts(judged)
    if args.json:
        settings = {"cores": os.cpu_count(), "threads": args.threads, "clients": CLIENTS}
        settings |= {"seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds}
        settings |= {"latency_seconds": args.latency_seconds}
        figures = {**settings, "models": results, "floors": judged}
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
