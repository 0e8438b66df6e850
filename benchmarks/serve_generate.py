"""Text generation: `gpuforge serve`'s completions beside a plain Hugging Face `model.generate` loop.

    python benchmarks/serve_generate.py [--model-dir DIR] [--levels 1,8] [--seconds 10] [--warmup 2]
                                        [--max-tokens 64] [--threads N] [--json out.json]

The model: bundled:gpt-tiny (GPT-2 shaped, byte tokenizer) with n_layer 4, n_head 4, n_embd 256, trained
for a few steps in fp32 on a few lines of Python in a temporary directory (its weights' quality does not
matter, only its speed); `--model-dir` uses an existing run's model/ directory (a causal-lm) instead.
The prompts: 16 lines of that Python, each cut to 16 characters (16 tokens: one byte a token).

The contenders, each on the same prompts, greedy (temperature 0), `--max-tokens` new tokens a request,
fp32, torch on the same `--threads` (OMP_NUM_THREADS and torch.set_num_threads; default: this machine's
cores), one process at a time, level by level (the server started, measured and stopped, then generate in
a fresh process, so that both meet about the same neighbours on a shared machine):
  gpuforge       `gpuforge serve MODEL --precision fp32 --device cpu` on 127.0.0.1 with no API key
                 (GPUFORGE_API_KEY is dropped from its environment), POST /v1/completions, not streamed.
                 Continuous batching: requests join and leave the running batch at every decode step.
                 For each of `--levels`, that many clients in closed loop, each its own keep-alive
                 connection (httpx.AsyncClient), in one load-generator process apart from this one and
                 the server (it shares the cores with the server: its CPU is shown). `--warmup` seconds,
                 then `--seconds` measured: an answer counts when it ends inside the window.
  hf-generate    no server: the model loaded as gpuforge loads it (gpuforge.artifact.load_artifact),
                 model.generate(do_sample=False, max_new_tokens=N, use_cache=True) under
                 torch.inference_mode, in a subprocess of its own. At 1: one prompt a call, in a loop. At
                 8 (any level above 1), two ways: `batched`, what a careful user does without a server,
                 the 8 prompts in one call, left-padded (every request's latency is the call's); and
                 `one at a time`, the 8 prompts run in turn, each request's latency counted from the start
                 of its group of 8 (as 8 requests arriving together and served in turn would see it; the
                 last group stops at the deadline, the requests it finished counted).
                 `--warmup` seconds of calls, then calls until `--seconds` have passed.

EOS: the completions route has no way to ask to go on past EOS (SamplingParams.ignore_eos exists in
serve/generate.py, but openai_api.py never sets it), so neither side ignores it: both stop at the model's
EOS, and tokens are counted as they come, EOS included (the server's usage.completion_tokens; for
generate, the new tokens up to and including the first EOS). `tok/req` shows whether answers ran their
full `--max-tokens`. As a check that both do the same work, the greedy answers the server gave are
compared with generate's at batch 1, prompt by prompt.

Figures per contender and level: completion tokens/s (summed over streams), requests/s, p50 and p90
latency, tokens a request, CPU in cores over the window: the server's processes or generate's process
(`proc`), the load client's, and anything else on the machine (`other`: /proc/stat less ours, the noisy
neighbour: with every core in torch's threads, a busy neighbour slows either side a lot); then the ratios
gpuforge / hf-generate in tokens/s and p50 at 1 and at each higher level (against batched and one at a
time). The server is stopped at the end, on an error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import Server, busy_seconds, closed_loop, drive, percentile, train, write_figures  # noqa: E402

CORPUS = """def add(a, b):
    return a + b

def scale(values, factor):
    return [v * factor for v in values]

class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count

def read_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f]

def mean(values):
    total = sum(values)
    return total / len(values) if values else 0.0

def clamp(value, low, high):
    return max(low, min(value, high))

for index, item in enumerate(items):
    print(index, item)
"""
PROMPT_CHARS = 16
STREAMS_BATCHED = "batched"
STREAMS_SEQUENTIAL = "one at a time"


def prompts() -> list[str]:
    cut = [line[:PROMPT_CHARS] for line in CORPUS.splitlines() if len(line) >= PROMPT_CHARS]
    return list(dict.fromkeys(cut))[:16]  # distinct


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# ---------------------------------------------------------------- the model


def train_model(tmp: Path) -> Path:
    """A run's model/ directory: bundled:gpt-tiny 4 x 256 after a few fp32 steps on CORPUS."""
    (tmp / "corpus.txt").write_text(CORPUS * 20)
    spec = {
        "name": "gpt-generate-bench",
        "model": {
            "source": "bundled:gpt-tiny",
            "task": "causal-lm",
            "options": {"n_layer": 4, "n_head": 4, "n_embd": 256},
        },
        "data": {"train": str(tmp / "corpus.txt"), "max_length": 128},
        "train": {"max_steps": 4, "batch_size": 8, "precision": "fp32"},
    }
    (tmp / "spec.json").write_text(json.dumps(spec))  # JSON is YAML
    return train(tmp / "spec.json", tmp / "run")


# ---------------------------------------------------------------- hf-generate (its own process)


def plain_generate(
    model_dir: str, levels: list[int], max_tokens: int, warmup: float, seconds: float, answers: bool
) -> dict:
    """model.generate with no server: rows as the load generator's, and the greedy answers at batch 1."""
    import torch

    from gpuforge.artifact import load_artifact

    module, tokenizer, _ = load_artifact(model_dir, "cpu")
    module.eval()
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    texts = prompts()

    def generate(batch: list[str]) -> list[list[int]]:
        """The new tokens of each prompt, up to and including the first EOS."""
        encoded = tokenizer(batch, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = module.generate(
                **encoded,
                max_new_tokens=max_tokens,
                do_sample=False,
                num_beams=1,
                use_cache=True,
                pad_token_id=pad,
                eos_token_id=eos,
            )
        rows = []
        for row in out[:, encoded["input_ids"].shape[1] :].tolist():
            rows.append(row[: row.index(eos) + 1] if eos in row else row)
        return rows

    def measure(clients: int, mode: str) -> dict:
        """Calls until `seconds` have passed, after `warmup` seconds of them. One at a time, a group of
        `clients` prompts may be cut short at the deadline: its requests done so far count."""
        k, tokens, latencies = 0, 0, []
        one_by_one = mode == STREAMS_SEQUENTIAL and clients > 1

        def one_round(deadline: float, record: bool) -> None:
            nonlocal k, tokens
            group = [texts[(k + i) % len(texts)] for i in range(clients if record or not one_by_one else 1)]
            k = (k + len(group)) % len(texts)
            started = time.perf_counter()
            for batch in [[t] for t in group] if one_by_one else [group]:
                rows = generate(batch)
                if record:
                    tokens += sum(len(r) for r in rows)
                    latencies.extend([1000 * (time.perf_counter() - started)] * len(rows))
                if time.perf_counter() >= deadline:
                    return

        deadline = time.perf_counter() + warmup
        one_round(deadline, False)
        while time.perf_counter() < deadline:
            one_round(deadline, False)
        cpu0, busy0, start = time.process_time(), busy_seconds(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            one_round(start + seconds, True)
        wall = time.perf_counter() - start
        cpu, busy = time.process_time() - cpu0, busy_seconds() - busy0
        latencies.sort()
        return {
            "contender": "hf-generate" if clients == 1 else f"hf-generate, {mode}",
            "clients": clients,
            "seconds": wall,
            "ok": len(latencies),
            "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "req_per_s": len(latencies) / wall,
            "tokens_per_req": tokens / len(latencies),
            "p50_ms": percentile(latencies, 0.50),
            "p90_ms": percentile(latencies, 0.90),
            "process_cpu": cpu / wall,
            "other_cpu": max(0.0, busy - cpu) / wall,
        }

    said = (
        {text: tokenizer.decode(generate([text])[0], skip_special_tokens=True) for text in texts}
        if answers
        else {}
    )
    rows = []
    for clients in levels:
        for mode in [STREAMS_BATCHED] if clients == 1 else [STREAMS_BATCHED, STREAMS_SEQUENTIAL]:
            rows.append(measure(clients, mode))
            print(
                json.dumps({"progress": rows[-1]["contender"], "clients": clients}),
                file=sys.stderr,
                flush=True,
            )
    return {"rows": rows, "answers": said, "threads": torch.get_num_threads(), "dtype": str(module.dtype)}


def run_plain(model: Path, clients: int, args: argparse.Namespace, answers: bool) -> dict:
    """generate at `clients` streams in a process of its own (and its greedy answers, if `answers`)."""
    command = [
        sys.executable,
        __file__,
        "--plain-worker",
        str(model),
        "--levels",
        str(clients),
        "--max-tokens",
        str(args.max_tokens),
        "--warmup",
        str(args.warmup),
        "--seconds",
        str(args.seconds),
        "--threads",
        str(args.threads),
    ] + (["--plain-answers"] if answers else [])
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **threads_env(args.threads)}
    )
    if done.returncode != 0:
        raise RuntimeError(f"hf-generate failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the load generator (its own process)


def loadgen(conn, url: str, clients: int, warmup: float, seconds: float, max_tokens: int) -> None:
    """`clients` closed-loop clients on one event loop; sends ("window", t0, t1), then ("result", {...})."""
    texts = prompts()
    statuses: Counter = Counter()
    latencies: list[float] = []
    completion_tokens: list[int] = []
    finish: Counter = Counter()
    answers: dict[str, str] = {}

    async def client(i: int, http: httpx.AsyncClient, t0: float, t1: float) -> None:
        k = i % len(texts)
        while time.time() < t1:
            prompt = texts[k]
            k = (k + 1) % len(texts)
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            sent = time.perf_counter()
            answer = None
            try:
                response = await http.post("/v1/completions", json=body)
                status = response.status_code
                if status == 200:
                    answer = response.json()
            except httpx.HTTPError as err:
                status = type(err).__name__
            elapsed = time.perf_counter() - sent
            if answer is not None:
                answers.setdefault(prompt, answer["choices"][0]["text"])
            if t0 <= time.time() <= t1:
                statuses[status] += 1
                if answer is not None:
                    latencies.append(1000 * elapsed)
                    completion_tokens.append(answer["usage"]["completion_tokens"])
                    finish[answer["choices"][0]["finish_reason"]] += 1
            if status == 429:
                await asyncio.sleep(1.0)

    timing = closed_loop(conn, url, clients, warmup, seconds, client, probe="/healthz", timeout=120)
    result = {
        "statuses": {str(k): v for k, v in statuses.items()},
        "latencies_ms": sorted(latencies),
        "completion_tokens": completion_tokens,
        "finish": dict(finish),
        "answers": answers,
    }
    conn.send(("result", {**result, **timing}))


def run_level(server: Server, clients: int, args: argparse.Namespace) -> dict:
    result, before, after = drive(
        server,
        clients,
        loadgen,
        (server.url, clients, args.warmup, args.seconds, args.max_tokens),
        lambda: (server.cpu_seconds(), busy_seconds(), time.process_time()),
        finish_s=300,
    )
    server_cpu, busy, own = (b - a for a, b in zip(before, after, strict=True))
    wall, lat, tokens = result["window_s"], result["latencies_ms"], result["completion_tokens"]
    return {
        "contender": "gpuforge",
        "clients": clients,
        "seconds": wall,
        "ok": len(lat),
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "req_per_s": len(lat) / wall,
        "tokens_per_req": statistics.mean(tokens) if tokens else float("nan"),
        "p50_ms": percentile(lat, 0.50),
        "p90_ms": percentile(lat, 0.90),
        "process_cpu": server_cpu / wall,
        "loadgen_cpu": result["cpu_s"] / wall,
        "other_cpu": max(0.0, busy - server_cpu - result["cpu_s"] - own) / wall,
        "statuses": result["statuses"],
        "finish": result["finish"],
        "answers": result["answers"],
    }


# ---------------------------------------------------------------- the run


def show(row: dict, what: str) -> None:
    print(
        f"  {row['contender']}, {row['clients']} streams ({what}): {row['tokens_per_s']:.1f} tok/s, "
        f"{row['req_per_s']:.2f} req/s, p50 {row['p50_ms']:.0f} ms, other CPU {row['other_cpu']:.2f} cores",
        flush=True,
    )


def print_table(rows: list[dict]) -> None:
    print(
        f"{'contender':<28}{'streams':>8}{'tok/s':>9}{'req/s':>8}{'p50':>8}{'p90':>8}{'tok/req':>9}"
        f"  {'CPU proc':>8}{'client':>7}{'other':>7}  answers"
    )
    print(f"{'':<28}{'':>8}{'':>9}{'':>8}{'ms':>8}{'ms':>8}{'':>9}  {'cores':>8}{'cores':>7}{'cores':>7}")
    for r in sorted(rows, key=lambda r: (r["clients"], r["contender"] != "gpuforge")):
        client = f"{r['loadgen_cpu']:.2f}" if "loadgen_cpu" in r else "-"
        answers = " ".join(f"{k}:{v}" for k, v in sorted(r.get("statuses", {}).items())) or "-"
        if r.get("finish"):
            answers += " (" + " ".join(f"{k}:{v}" for k, v in sorted(r["finish"].items())) + ")"
        print(
            f"{r['contender']:<28}{r['clients']:>8}{r['tokens_per_s']:>9.1f}{r['req_per_s']:>8.2f}"
            f"{r['p50_ms']:>8.0f}{r['p90_ms']:>8.0f}{r['tokens_per_req']:>9.1f}  {r['process_cpu']:>8.2f}"
            f"{client:>7}{r['other_cpu']:>7.2f}  {answers}"
        )


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["contender"], r["clients"]): r for r in rows}
    out = []
    for (name, clients), r in sorted(by.items(), key=lambda item: item[0][1]):
        if not name.startswith("hf-generate"):
            continue
        served = by.get(("gpuforge", clients))
        if served and r["tokens_per_s"] > 0:
            out.append(
                {
                    "clients": clients,
                    "against": name,
                    "tokens_per_s": served["tokens_per_s"] / r["tokens_per_s"],
                    "p50": served["p50_ms"] / r["p50_ms"] if r["p50_ms"] > 0 else float("nan"),
                }
            )
    return out


def agreement(served: dict[str, str], plain: dict[str, str]) -> tuple[int, int]:
    common = [p for p in served if p in plain]
    return sum(served[p] == plain[p] for p in common), len(common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a causal-lm model/ directory (default: train one)")
    parser.add_argument("--levels", default="1,8", help="concurrent streams, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens a request")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--plain-worker", type=Path, help=argparse.SUPPRESS)  # the hf-generate subprocess
    parser.add_argument("--plain-answers", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]

    if args.plain_worker:
        import torch

        torch.set_num_threads(args.threads)
        figures = plain_generate(
            str(args.plain_worker), levels, args.max_tokens, args.warmup, args.seconds, args.plain_answers
        )
        print(json.dumps(figures))
        return

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill also goes through the `finally`s
    os.environ.pop("GPUFORGE_API_KEY", None)  # the server listens on loopback with no key
    rows: list[dict] = []
    plain: dict = {}  # the first generate run's: its dtype and its greedy answers at batch 1
    server: Server | None = None
    with tempfile.TemporaryDirectory(prefix="gpuforge-serve-generate-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            model = args.model_dir or train_model(tmp)
            print(
                f"model {model}; {len(prompts())} prompts of {PROMPT_CHARS} characters, "
                f"{args.max_tokens} new tokens, greedy, fp32; torch threads {args.threads}; "
                f"{os.cpu_count()} cores; levels {levels}, {args.warmup:g} s warm-up + "
                f"{args.seconds:g} s each",
                flush=True,
            )
            command = [
                sys.executable, "-m", "gpuforge", "serve", str(model),
                "--precision", "fp32", "--device", "cpu", "--host", "127.0.0.1",
            ]  # fmt: skip
            for clients in levels:  # per level the server, then generate: about the same neighbours
                server = Server(
                    "gpuforge", command, "/readyz", threads_env(args.threads), tmp / "gpuforge.log"
                )
                print(f"gpuforge, {clients} streams: starting ...", flush=True)
                server.start()
                info = httpx.get(server.url + "/info", timeout=5).json()
                row = run_level(server, clients, args)
                server.stop()
                server = None
                rows.append(row)
                show(row, f"{info['precision']} on {info['device']}, max batch {info['max_batch']}")
                print(f"hf-generate, {clients} streams (no server) ...", flush=True)
                done = run_plain(model, clients, args, answers=not plain)
                plain = plain or done
                for row in done["rows"]:
                    rows.append(row)
                    show(row, f"{done['dtype']}, torch threads {done['threads']}")
        finally:
            if server is not None:
                server.stop()

    print()
    print(
        f"serve generate: {os.cpu_count()} cores, torch threads {args.threads}, fp32 ({plain['dtype']} in "
        f"generate), greedy, {args.max_tokens} new tokens a request, {PROMPT_CHARS}-token prompts, "
        f"{args.seconds:g} s per level after {args.warmup:g} s warm-up; tok/s summed over streams"
    )
    print_table(rows)
    print()
    compared = ratios(rows)
    for c in compared:
        print(
            f"gpuforge / {c['against']} at {c['clients']}: {c['tokens_per_s']:.2f}x tok/s, "
            f"p50 {c['p50']:.2f}x"
        )
    checks = {}
    for r in rows:
        if r["contender"] == "gpuforge":
            same, of = agreement(r.pop("answers"), plain["answers"])
            checks[r["clients"]] = {"same": same, "of": of}
            print(
                f"greedy answers at {r['clients']} streams equal to generate's at batch 1: "
                f"{same}/{of} prompts"
            )
    if args.json:
        write_figures(
            args.json,
            args,
            levels,
            max_tokens=args.max_tokens,
            rows=rows,
            ratios=compared,
            answers_equal=checks,
        )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
