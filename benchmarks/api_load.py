"""Load on the HTTP API: concurrent clients reading jobs from a real `gpuforge server` on loopback.

    python benchmarks/api_load.py [--clients 50] [--seconds 10 | --requests N] [--jobs 200]
                                  [--workers 1] [--list-fraction 0.25] [--think-ms 250] [--json out.json]

A real server process (`python -m gpuforge server`, a temporary GPUFORGE_HOME, SQLite, scheduling off so
jobs stay queued, data roots = examples/) gets `--jobs` jobs (examples/digits-cnn.yaml, submitted one by
one). Then `--clients` clients, each with its own keep-alive connection (httpx.AsyncClient), send requests
one after another (closed loop, a random pause of mean `--think-ms` between them) for `--seconds` or
until `--requests` in all: GET /api/v1/jobs?limit=50 (a `--list-fraction` of them) and
GET /api/v1/jobs/{id} of a random job.
The clients run in `--workers` load-generator processes (asyncio, one event loop each), apart from this
one. Latency is measured by the client, request sent to body read; an error is a non-200 answer or a
failed request. Table per route: requests, errors, req/s, p50/p90/p99/max in ms; CPU seconds used by the
server and by the load generator, which share this machine's cores. Floor: p99 under 50 ms at 50
concurrent clients. The default client polls about 4 times a second (a watcher of `gpuforge jobs` polls
once every second or two); `--think-ms 0` measures saturation instead, where latency ~ clients /
throughput and this machine's 2 cores are shared by server and load generator.
The server is stopped at the end, on an error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402

SPEC = ROOT / "examples" / "digits-cnn.yaml"
FLOOR_P99_MS, FLOOR_CLIENTS = 50.0, 50
LIST, ONE = "GET /api/v1/jobs?limit=50", "GET /api/v1/jobs/{id}"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def submit_jobs(url: str, headers: dict, n: int) -> tuple[list[int], float]:
    body = {"spec": load_spec(SPEC).to_yaml()}  # resolved: the model's path is absolute
    start = time.perf_counter()
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        ids = []
        for _ in range(n):
            response = client.post("/api/v1/jobs", json=body)
            response.raise_for_status()
            ids.append(response.json()["id"])
    return ids, time.perf_counter() - start


async def one_client(url, headers, ids, args, seed, start_at, stop_at, quota, out) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)  # its own one connection
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:
        await client.get("/healthz")  # open the connection before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        if args.think_ms:  # each client joins at a random moment of its first pause, not all at once
            await asyncio.sleep(rng.uniform(0, args.think_ms / 1000))
        done = 0
        while time.time() < stop_at and (quota is None or done < quota):
            route = LIST if rng.random() < args.list_fraction else ONE
            path = "/api/v1/jobs?limit=50" if route == LIST else f"/api/v1/jobs/{rng.choice(ids)}"
            start = time.perf_counter()
            try:
                response = await client.get(path)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            elapsed_ms = 1000 * (time.perf_counter() - start)
            out[route].append(elapsed_ms if ok else -1.0)  # -1: an error
            done += 1
            if args.think_ms:  # exponential: clients drift apart as real ones do, not in lockstep bursts
                await asyncio.sleep(rng.expovariate(1000 / args.think_ms))


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C: it ends the run


def load_worker(url, headers, ids, args, clients: range, start_at: float, seconds: float):
    """One load-generator process: `clients` concurrent clients on one event loop."""
    out = {LIST: [], ONE: []}
    stop_at = start_at + seconds
    quota = None if args.requests is None else max(1, args.requests // args.clients)

    async def run():
        await asyncio.gather(
            *(one_client(url, headers, ids, args, i, start_at, stop_at, quota, out) for i in clients)
        )

    cpu = time.process_time()
    asyncio.run(run())
    return out, time.process_time() - cpu, time.time()


def percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))] if sorted_ms else float("nan")


def summarize(name: str, samples: list[float], wall: float) -> dict:
    ok = sorted(ms for ms in samples if ms >= 0)
    row = {"route": name, "requests": len(samples), "errors": len(samples) - len(ok)}
    row["req_per_s"] = len(samples) / wall
    for label, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        row[f"{label}_ms"] = percentile(ok, q)
    row["max_ms"] = ok[-1] if ok else float("nan")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the load runs")
    parser.add_argument("--requests", type=int, help="stop after about this many requests in all instead")
    parser.add_argument("--jobs", type=int, default=200, help="jobs submitted before the load")
    parser.add_argument("--workers", type=int, default=1, help="load-generator processes")
    parser.add_argument("--list-fraction", type=float, default=0.25, help="share of list requests")
    parser.add_argument(
        "--think-ms",
        type=float,
        default=250.0,
        help="mean pause of each client between requests (exponentially distributed)",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    workers = max(1, min(args.workers, args.clients))
    # A run bounded by --requests still stops after an hour; one bounded by time stops at --seconds.
    seconds = 3600.0 if args.requests is not None else args.seconds

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill also goes through the `finally`s
    with tempfile.TemporaryDirectory(prefix="gpuforge-api-load-") as tmp:
        log_path = Path(tmp) / "server.log"
        local = LocalServer(
            Path(tmp) / "home",
            log=log_path,
            GPUFORGE_SCHEDULE="false",  # the API alone: jobs stay queued
            GPUFORGE_DATA_ROOTS=str(ROOT / "examples"),
        ).start()
        server, url = local.process, local.url
        try:
            headers = {"Authorization": f"Bearer {local.key}"}
            ids, submit_s = submit_jobs(url, headers, args.jobs)
            store = os.environ.get("GPUFORGE_DB", "SQLite").split(":")[0]
            print(f"server: pid {server.pid} on {url}, {store}, {len(ids)} jobs queued in {submit_s:.1f} s")

            shares = [range(w, args.clients, workers) for w in range(workers)]
            start_at = time.time() + 2.0 + 0.02 * args.clients  # once every client has connected
            server_cpu = cpu_seconds(server.pid)
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=ignore_sigint)
            try:
                pending = [
                    pool.apply_async(load_worker, (url, headers, ids, args, share, start_at, seconds))
                    for share in shares
                ]
                results = [p.get() for p in pending]
            finally:
                pool.terminate()  # on Ctrl-C too: no load-generator process outlives the run
                pool.join()
            wall = max(end for _, _, end in results) - start_at
            if server_cpu is not None:
                server_cpu = cpu_seconds(server.pid) - server_cpu
            if server.poll() is not None:
                raise RuntimeError(f"the server died under load:\n{log_path.read_text()[-3000:]}")
        finally:
            local.stop()

    samples = {LIST: [], ONE: []}
    for out, _, _ in results:
        for route, values in out.items():
            samples[route] += values
    rows = [summarize(route, values, wall) for route, values in samples.items()]
    rows.append(summarize("all", samples[LIST] + samples[ONE], wall))
    load_cpu = sum(cpu for _, cpu, _ in results)

    print(
        f"load: {args.clients} clients (one connection each) in {workers} process(es), closed loop, "
        f"think {args.think_ms:g} ms, {wall:.1f} s"
    )
    print(f"{'route':<28}{'requests':>9}{'errors':>8}{'req/s':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
    for r in rows:
        print(
            f"{r['route']:<28}{r['requests']:>9}{r['errors']:>8}{r['req_per_s']:>9.0f}"
            f"{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}   (ms)"
        )
    cores = os.cpu_count()
    server_cpu_text = f"{server_cpu:.1f} s ({100 * server_cpu / wall:.0f}% of a core)" if server_cpu else "?"
    print(
        f"CPU over the run: server {server_cpu_text}, load generator {load_cpu:.1f} s "
        f"({100 * load_cpu / wall:.0f}% of a core); both on the same {cores} cores, so the figures "
        "are a lower bound on what the server alone does"
    )
    total = rows[-1]
    if args.clients < FLOOR_CLIENTS:
        verdict = f"not judged (under {FLOOR_CLIENTS} clients)"
    elif total["p99_ms"] < FLOOR_P99_MS and total["errors"] == 0:
        verdict = "PASS"
    else:
        verdict = "BELOW"
    print(
        f"p99 {total['p99_ms']:.1f} ms at {args.clients} concurrent clients, {total['errors']} errors   "
        f"floor p99 < {FLOOR_P99_MS:g} ms at {FLOOR_CLIENTS} clients   {verdict}"
    )
    if args.json:
        figures = {
            "clients": args.clients,
            "workers": workers,
            "seconds": wall,
            "jobs": len(ids),
            "cores": cores,
            "server_cpu_s": server_cpu,
            "load_cpu_s": load_cpu,
            "routes": rows,
            "verdict": verdict,
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
