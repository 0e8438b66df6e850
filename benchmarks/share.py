"""Fractions of a device on this CPU (issue 42), through a real `gpuforge server` on loopback with one CPU
slot (all the machine's cores): two half-slot training jobs side by side against the same two one after the
other on the whole slot, and a half-slot replica's latency while a half-slot job trains beside it.

    python benchmarks/share.py [--rounds 2] [--steps 30] [--seconds 15] [--warmup 2] [--clients 2]
                               [--quick] [--json benchmarks/results/share.json]

The job: the MiniLM topic classifier of examples/minilm-topics.yaml (all-MiniLM-L6-v2, 22.7M parameters,
batch 32 of 64 tokens, fp32; no evaluation or checkpoint before its end), `--steps` steps: every step is
matrix products on the CPU, nothing sleeps. Before anything is timed, one 2-step job on the whole slot
warms the disk cache and the imports; its model is the one part 2 serves (with --quick, part 1's first
job's, and nothing warms).

1. Side by side (floor: the pair's wall time <= 1.1x the serial wall time; the ratio, lower is better).
   serial        two jobs with resources.devices 1, submitted at once: they queue and run one after the
                 other on the whole slot (OMP threads = the slot's cores);
   side by side  the same two with resources.devices 0.5: the server packs both onto the slot, each pinned
                 to its half of the cores with that many threads.
   Wall: from the first submit to the later of the two jobs' finished_at (the server's; runner start-up,
   model load, the queue's hand-over included). Jobs: as the server saw them run, each job's
   started_at..finished_at, summed for the serial pair (the hand-over gap left out) and the span from
   the first start to the last finish for the side-by-side pair. Per job, from its run directory: the
   runner's set-up (events.jsonl `setup_s`), the median step (summary.json) and the threads it ran with
   (its `started` event); the cores it held, from the job's `isolation` and the runner's affinity read
   while it ran. Rounds are interleaved ABBA (serial, pair, pair, serial, ...) so that a drift of the
   shared machine falls on both alike, `--rounds` of each; medians.
2. A replica beside a training job (floor: its p99 while a half-slot job trains <= 1.5x its p99 alone).
   The warm-up job's model is deployed with devices 0.5 (one replica, min = max = 1, fp32). `--clients`
   threads in closed loop, each its own keep-alive connection, one sentence of examples/data/topics.jsonl
   a request, `--warmup` s then `--seconds` s measured, two ways in turn: through the server's address
   (POST /api/v1/deployments/share/predict: what a client sees; the server process itself is not pinned)
   and straight to the replica's port (with the deployment's replica key, derived as the server does from
   <home>/worker.secret: the replica alone). Phases: alone; beside a job with devices 0.5 (submitted once
   the first phase is done, measured from its step 1 while it runs; its steps sized from part 1's
   half-slot step time to outlast both windows); alone again after it finished. The floor is judged
   against the median of the two alone phases, both ways (through the server and straight).

Beside every run and window, what the machine's cores did (/proc/stat) less what the server, everything
under it and this process used: other processes' load (someone else's tests on a shared machine), and in
part 2 the share of the replica's own core it got and what else ran there (the unpinned server and this
process's clients, pushed onto it once the job fills the other cores).

Prints a table with the CPU model (measure, figure, floor, PASS or BELOW: a figure short of its floor is
shown as it is) and writes every figure to `--json`. `--quick`: 1 round of 8 steps, 5 s windows (about
2.5 minutes on 2 cores); the defaults take about 7.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.hardware.probe import cpu_model_name  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402

SPEC = ROOT / "examples" / "minilm-topics.yaml"
SENTENCES = [
    json.loads(line)["text"]
    for line in (ROOT / "examples" / "data" / "topics.jsonl").read_text().splitlines()
]
PAIR_FLOOR = 1.1  # issue 42: side-by-side wall / serial wall, at most
P99_FLOOR = 1.5  # issue 42: replica p99 beside a training job / alone, at most
ENDED = ("finished", "failed", "cancelled", "pruned")
DEPLOYMENT = "share"
NOISY_CORES = 0.2  # other processes' load above which a run or window is said to be disturbed


def stamp(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Bench:
    """The server under test and what the benchmark reads of it: its API, its store, its runners."""

    def __init__(self, server: LocalServer):
        self.server, self.home = server, server.home
        self.http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=120
        )
        self.client = server.client()
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            from gpuforge.store.db import connect

            self._engine = connect(f"sqlite:///{self.home / 'gpuforge.db'}")
        return self._engine

    def submit(self, name: str, steps: int, devices: float) -> int:
        overrides = [
            f"name={name}",
            f"train.max_steps={steps}",
            "train.precision=fp32",
            "train.eval_every=100000",
            "train.checkpoint_every=100000",
            f"resources.devices={devices:g}",
        ]
        return self.client.submit(load_spec(SPEC, overrides))["id"]

    def job(self, job_id: int) -> dict:
        return self.http.get(f"/api/v1/jobs/{job_id}").json()

    def wait_job(self, job_id: int, until, timeout: float = 900.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            if job["state"] in ENDED:
                raise RuntimeError(f"job {job_id} {job['state']}: {job.get('reason')}")
            time.sleep(0.2)
        raise RuntimeError(f"job {job_id}: not there after {timeout:g} s: {job}")

    def runner_pid(self, job_id: int) -> int | None:
        from gpuforge.store.db import session
        from gpuforge.store.models import Job

        with session(self.engine) as s:
            return s.get(Job, job_id).pid

    def deployment(self):
        from sqlalchemy import select

        from gpuforge.store.db import session
        from gpuforge.store.models import Deployment

        with session(self.engine) as s:
            found = s.scalar(select(Deployment).where(Deployment.name == DEPLOYMENT))
            s.expunge(found)
            return found


def affinity(pid: int | None) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except (OSError, AttributeError):
        return None


def run_facts(run_dir: str) -> dict:
    """What the runner wrote: set-up seconds and threads (its `started` event), the median step."""
    run = Path(run_dir)
    started = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "started":
            started = event
            break
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return {
        "setup_s": started.get("setup_s"),
        "device": started.get("device"),  # "AMD EPYC x2 threads"
        "median_step_s": summary.get("median_step_s"),
        "steps": summary.get("steps"),
    }


# --- 1. two jobs, serial against side by side --------------------------------------------------------


def two_jobs(bench: Bench, mode: str, round_: int, steps: int) -> dict:
    devices = 1.0 if mode == "serial" else 0.5
    began, usage = time.time(), Usage(bench.server.process.pid)
    ids = [bench.submit(f"{mode.replace(' ', '-')}-{round_}-{x}", steps, devices) for x in "ab"]
    seen: dict[int, dict] = {}  # each job's cores while it ran: its record's words, its runner's affinity
    while True:
        jobs = [bench.job(i) for i in ids]
        for job in jobs:
            if job["state"] == "running" and job["id"] not in seen and (job["step"] or 0) >= 1:
                pid = bench.runner_pid(job["id"])
                seen[job["id"]] = {"isolation": job["isolation"], "affinity": affinity(pid)}
        if all(j["state"] in ENDED for j in jobs):
            break
        time.sleep(0.5)
    for job in jobs:
        if job["state"] != "finished":
            raise RuntimeError(f"job {job['id']} {job['state']}: {job.get('reason')}")
    starts = [stamp(j["started_at"]) for j in jobs]
    ends = [stamp(j["finished_at"]) for j in jobs]
    per_job = [
        {
            "id": j["id"],
            "devices": j["devices"],
            "device_share": j["device_share"],
            "run_s": end - start,
            **seen.get(j["id"], {}),
            **run_facts(j["run_dir"]),
        }
        for j, start, end in zip(jobs, starts, ends, strict=True)
    ]
    jobs_s = (
        sum(e - s for s, e in zip(starts, ends, strict=True)) if mode == "serial" else max(ends) - min(starts)
    )
    return {"mode": mode, "round": round_, "wall_s": max(ends) - began, "jobs_s": jobs_s, "jobs": per_job,
            "machine": usage.since()}  # fmt: skip


def side_by_side(bench: Bench, rounds: int, steps: int) -> dict:
    order = []
    for r in range(rounds):  # ABBA: serial, pair, pair, serial, ...
        order += [("serial", r), ("side by side", r)] if r % 2 == 0 else [("side by side", r), ("serial", r)]
    runs = []
    for mode, r in order:
        run = two_jobs(bench, mode, r, steps)
        runs.append(run)
        threads = ", ".join(
            f"{j['device']} on {j.get('isolation') or j.get('affinity')}" for j in run["jobs"]
        )
        machine = run["machine"]
        print(
            f"  round {r + 1} {mode:<12} wall {run['wall_s']:6.1f} s  jobs {run['jobs_s']:6.1f} s  "
            f"median step {median([j['median_step_s'] for j in run['jobs']]):.3f} s  ({threads}); "
            f"other processes {machine['others_cores']:.2f} cores, steal {machine['steal_cores']:.2f}",
            flush=True,
        )

    def of(mode: str, key: str) -> float:
        return median([run[key] for run in runs if run["mode"] == mode])

    serial_wall, pair_wall = of("serial", "wall_s"), of("side by side", "wall_s")
    serial_jobs, pair_jobs = of("serial", "jobs_s"), of("side by side", "jobs_s")

    def of_machine(mode: str) -> float:
        return median([run["machine"]["others_cores"] for run in runs if run["mode"] == mode])

    def step_of(mode: str) -> float:
        return median([j["median_step_s"] for run in runs if run["mode"] == mode for j in run["jobs"]])

    return {
        "steps": steps,
        "rounds": rounds,
        "runs": runs,
        "serial_wall_s": serial_wall,
        "side_by_side_wall_s": pair_wall,
        "wall_ratio": pair_wall / serial_wall,
        "serial_jobs_s": serial_jobs,
        "side_by_side_jobs_s": pair_jobs,
        "jobs_ratio": pair_jobs / serial_jobs,
        "serial_others_cores": of_machine("serial"),
        "side_by_side_others_cores": of_machine("side by side"),
        "serial_median_step_s": step_of("serial"),
        "side_by_side_median_step_s": step_of("side by side"),
        "serial_threads": sorted(
            {j["device"] for run in runs if run["mode"] == "serial" for j in run["jobs"]}
        ),
        "side_by_side_isolation": sorted(
            {str(j.get("isolation")) for run in runs if run["mode"] != "serial" for j in run["jobs"]}
        ),
        "side_by_side_affinity": [
            [j.get("affinity") for j in run["jobs"]] for run in runs if run["mode"] != "serial"
        ],
    }


# --- 2. a replica beside a training job ------------------------------------------------------------------


class Load:
    """`clients` threads in closed loop on `url`, each its own keep-alive connection: (sent, answered,
    status) per request, on this process's monotonic clock."""

    def __init__(self, url: str, headers: dict, clients: int):
        self.url, self.headers = url, headers
        self.answers: list[tuple[float, float, int | str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(headers=self.headers, timeout=60) as http:
            n = i * 37
            while not self.stop.is_set():
                body = {"inputs": [SENTENCES[n % len(SENTENCES)]]}
                sent = time.monotonic()
                try:
                    status = http.post(self.url, json=body).status_code
                except httpx.HTTPError as err:
                    status = type(err).__name__
                with self.lock:
                    self.answers.append((sent, time.monotonic(), status))
                n += 1

    def window(self, warmup: float, seconds: float, until=None) -> tuple[list[tuple], float]:
        """Run `warmup` then `seconds` (or until `until()` is true, polled each 0.25 s): the answers that
        ended inside the measured window, and its length."""
        for t in self.threads:
            t.start()
        time.sleep(warmup)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds and not (until and until()):
            time.sleep(0.25)
        t1 = time.monotonic()
        self.stop.set()
        for t in self.threads:
            t.join()
        return [a for a in self.answers if t0 <= a[1] < t1], t1 - t0


def latency(answers: list[tuple], seconds: float) -> dict:
    ok = sorted(1000 * (a[1] - a[0]) for a in answers if a[2] == 200)
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a[2])] = statuses.get(str(a[2]), 0) + 1
    return {
        "requests": len(answers),
        "statuses": statuses,
        "seconds": seconds,
        "req_per_s": len(ok) / seconds if seconds else 0.0,
        "p50_ms": statistics.median(ok) if ok else None,
        "p99_ms": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None,
    }


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` (its own threads, not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, TypeError):
        return None


class Usage:
    """What the machine's cores did from its start to `since()`: each core's busy seconds and steal (the
    hypervisor's), and how much of it was ours (the server and every process under it, this process) or
    other processes' (someone else's tests on the shared machine: the noisy neighbour)."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.t0, self.cores0, self.ours0 = time.monotonic(), per_core(), self.ours()

    def ours(self) -> float:
        total = sum(psutil.Process().cpu_times()[:2])
        try:
            server = psutil.Process(self.server_pid)
            for proc in [server, *server.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += sum(proc.cpu_times()[:4])  # its own and its ended children's
        except psutil.Error:
            pass
        return total

    def since(self) -> dict:
        seconds, cores, ours = time.monotonic() - self.t0, per_core(), self.ours()
        busy = {c: cores[c][0] - self.cores0[c][0] for c in cores}
        steal = sum(cores[c][1] - self.cores0[c][1] for c in cores)
        return {
            "seconds": seconds,
            "core_busy": {c: b / seconds for c, b in busy.items()},  # 0..1 each
            "steal_cores": steal / seconds,
            "ours_cores": (ours - self.ours0) / seconds,
            "others_cores": max(0.0, sum(busy.values()) - (ours - self.ours0)) / seconds,
        }


def per_core() -> dict[int, tuple[float, float]]:
    """core -> (busy seconds since boot, stolen seconds), from /proc/stat."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            found[int(name[3:])] = ((user + nice + system + irq + softirq) / tick, steal / tick)
    return found


def measure_phase(bench: Bench, name: str, replica: dict, args, until=None) -> dict:
    """Both ways in turn, through the server and straight to the replica."""
    ways = {
        "server": (f"{bench.server.url}/api/v1/deployments/{DEPLOYMENT}/predict", dict(bench.http.headers)),
        "direct": (
            f"http://127.0.0.1:{replica['port']}/predict",
            {"Authorization": f"Bearer {replica['key']}"},
        ),
    }
    figures = {"phase": name}
    for way, (url, headers) in ways.items():
        pids = {"server": bench.server.process.pid, "replica": replica["pid"], "benchmark": os.getpid()}
        before, usage = {k: cpu_seconds(p) for k, p in pids.items()}, Usage(bench.server.process.pid)
        answers, seconds = Load(url, headers, args.clients).window(args.warmup, args.seconds, until)
        after, machine = {k: cpu_seconds(p) for k, p in pids.items()}, usage.since()
        cpu = {
            k: (after[k] - before[k]) / machine["seconds"] for k in pids if None not in (after[k], before[k])
        }
        mine = replica["affinity"] or []
        on_its_cores = sum(machine["core_busy"].get(c, 0.0) for c in mine)
        figures[way] = latency(answers, seconds) | {
            "cpu_cores": cpu,  # each process's CPU over the window and its warm-up, in cores
            "machine": machine,
            # of the replica's own cores' time: what it got, what everything else on them took
            "replica_got": cpu.get("replica", 0.0) / max(1, len(mine)),
            "others_on_its_cores": max(0.0, on_its_cores - cpu.get("replica", 0.0)) / max(1, len(mine)),
        }
        f = figures[way]
        print(
            f"  {name:<14} {way:<6} {f['requests']:>5} requests  {f['req_per_s']:6.1f} req/s  "
            f"p50 {f['p50_ms'] or 0:6.1f} ms  p99 {f['p99_ms'] or 0:6.1f} ms  {f['statuses']}; "
            f"the replica got {f['replica_got']:.0%} of its core, others {f['others_on_its_cores']:.0%}",
            flush=True,
        )
    return figures


def beside_a_job(bench: Bench, model_job: int, half_step_s: float, args) -> dict:
    from gpuforge.scheduler.worker_keys import load_secret, worker_key

    body = {"job_id": model_job, "name": DEPLOYMENT, "devices": 0.5, "min_replicas": 1, "max_replicas": 1,
            "options": {"precision": "fp32"}}  # fmt: skip
    bench.http.post("/api/v1/deployments", json=body).raise_for_status()
    deadline = time.monotonic() + 300
    while True:
        d = bench.http.get(f"/api/v1/deployments/{DEPLOYMENT}").json()
        if d["state"] == "ready" and any(w["ready"] for w in d["workers"]):
            break
        if d["state"] in ("failed", "stopped") or time.monotonic() > deadline:
            raise RuntimeError(f"deployment {DEPLOYMENT}: {d}")
        time.sleep(0.25)
    worker = next(w for w in d["workers"] if w["ready"])
    row = bench.deployment()
    stored = next(w for w in row.workers if w.get("index") == worker["index"])
    replica = {
        "pid": worker["pid"],
        "port": worker["port"],
        "device": worker["device"],
        "isolation": stored.get("isolation"),  # the API's replica record does not carry it: the store's
        "affinity": affinity(worker["pid"]),
        "key": worker_key(load_secret(bench.home), row),
    }
    print(
        f"  replica on {replica['device']}: {replica['isolation']}, affinity {replica['affinity']}",
        flush=True,
    )
    phases = [measure_phase(bench, "alone", replica, args)]

    # long enough for both windows and their warm-ups from its step 1, at part 1's half-slot step time
    windows_s = 2 * (args.warmup + args.seconds)
    steps = math.ceil(1.5 * windows_s / half_step_s) + 3
    job_id = bench.submit("beside-replica", steps, 0.5)
    job = bench.wait_job(job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 1)
    job_facts = {
        "id": job_id,
        "steps": steps,
        "isolation": job["isolation"],
        "affinity": affinity(bench.runner_pid(job_id)),
        "replica_affinity_then": affinity(replica["pid"]),
    }
    print(f"  job {job_id} ({steps} steps) on {job['devices']}: {job['isolation']}, affinity "
          f"{job_facts['affinity']}", flush=True)  # fmt: skip
    ended = threading.Event()

    def watch() -> None:
        while not ended.is_set():
            if bench.job(job_id)["state"] in ENDED:
                ended.set()
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    beside = measure_phase(bench, "beside a job", replica, args, until=ended.is_set)
    beside["job_ran_throughout"] = not ended.is_set()
    if ended.is_set():
        print("  (the job ended before the windows did: they were cut short)", flush=True)
    done = bench.wait_job(job_id, lambda j: j["state"] in ENDED)
    ended.set()
    job_facts |= {"state": done["state"], "run_s": stamp(done["finished_at"]) - stamp(done["started_at"])}
    job_facts |= run_facts(done["run_dir"])
    phases += [beside, measure_phase(bench, "alone again", replica, args)]

    bench.http.delete(f"/api/v1/deployments/{DEPLOYMENT}")
    deadline = time.monotonic() + 120
    while bench.http.get(f"/api/v1/deployments/{DEPLOYMENT}").json()["state"] != "stopped":
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)

    result = {"clients": args.clients, "warmup_s": args.warmup, "seconds": args.seconds,
              "replica": {k: v for k, v in replica.items() if k != "key"}, "job": job_facts,
              "phases": phases}  # fmt: skip
    for way in ("server", "direct"):
        alone = [p[way]["p99_ms"] for p in phases if p["phase"] != "beside a job"]
        alone_p50 = [p[way]["p50_ms"] for p in phases if p["phase"] != "beside a job"]
        result[way] = {
            "alone_p99_ms": median(alone),
            "alone_p50_ms": median(alone_p50),
            "beside_p99_ms": beside[way]["p99_ms"],
            "beside_p50_ms": beside[way]["p50_ms"],
            "p99_ratio": beside[way]["p99_ms"] / median(alone)
            if beside[way]["p99_ms"] and median(alone)
            else None,
            "p99_ratio_to_first": (
                beside[way]["p99_ms"] / alone[0] if beside[way]["p99_ms"] and alone[0] else None
            ),
        }
    return result


# --- the table ---------------------------------------------------------------------------------------------


def verdicts(part1: dict, part2: dict) -> list[dict]:
    rows = [
        {
            "measure": "side-by-side wall / serial wall (2 jobs)",
            "figure": part1["wall_ratio"],
            "floor": f"<= {PAIR_FLOOR}",
            "ok": part1["wall_ratio"] <= PAIR_FLOOR,
        }
    ]
    for way, words in (("server", "through the server"), ("direct", "straight to the replica")):
        ratio = part2[way]["p99_ratio"]
        rows.append(
            {
                "measure": f"replica p99 beside a job / alone ({words})",
                "figure": ratio,
                "floor": f"<= {P99_FLOOR}",
                "ok": ratio is not None and ratio <= P99_FLOOR,
            }
        )
    return rows


def report(result: dict) -> None:
    p1, p2, cpu = result["side_by_side"], result["replica"], result["cpu"]
    print(f"\nfractions of a device: one CPU slot of {cpu} ({result['cores']} cores), "
          f"{p1['steps']} steps a job, medians of {p1['rounds']} round(s)")  # fmt: skip
    print(f"{'':<46}{'serial (devices 1)':>19}{'side by side (0.5)':>19}")
    for label, key, form in (
        ("wall, first submit to both finished, s", "wall_s", ".1f"),
        ("jobs as the server saw them run, s", "jobs_s", ".1f"),
        ("median step, s", "median_step_s", ".3f"),
        ("other processes on the machine, cores", "others_cores", ".2f"),
    ):
        serial, pair = p1[f"serial_{key}"], p1[f"side_by_side_{key}"]
        print(f"{label:<46}{serial:>19{form}}{pair:>19{form}}")
    print(f"serial: each job {' / '.join(p1['serial_threads'])} on its slot's cores")
    print(f"side by side: {' / '.join(p1['side_by_side_isolation'])}; "
          f"runner affinities {p1['side_by_side_affinity']}")  # fmt: skip

    job = p2["job"]
    print(f"\nreplica at devices 0.5 ({p2['replica']['isolation']}), {p2['clients']} clients in closed "
          f"loop, {p2['seconds']:g} s a window; beside it job {job['id']} ({job['isolation']})")  # fmt: skip
    print(f"{'phase':<14}{'way':<8}{'requests':>9}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'replica got':>13}"
          f"{'else on its core':>18}{'other procs':>13}")  # fmt: skip
    for phase in p2["phases"]:
        for way in ("server", "direct"):
            f = phase[way]
            print(f"{phase['phase']:<14}{way:<8}{f['requests']:>9}{f['req_per_s']:>8.1f}"
                  f"{f['p50_ms'] or 0:>9.1f}{f['p99_ms'] or 0:>9.1f}{f['replica_got']:>13.0%}"
                  f"{f['others_on_its_cores']:>18.0%}{f['machine']['others_cores']:>13.2f}")  # fmt: skip
    if not p2["phases"][1]["job_ran_throughout"]:
        print("(the job ended before the windows beside it did: they were cut short)")
    print(
        "replica got: its CPU over its core's time; else on its core: what the rest of the machine ran there "
        "(the server, this process's clients, others); other procs: cores busy with processes not ours"
    )
    noisy = [run["machine"]["others_cores"] for run in p1["runs"]]
    noisy += [phase[way]["machine"]["others_cores"] for phase in p2["phases"] for way in ("server", "direct")]
    if max(noisy) > NOISY_CORES:
        print(
            f"NOTE: other processes kept up to {max(noisy):.2f} cores busy during some runs or windows: "
            "the machine was not quiet, the figures beside them are disturbed"
        )

    print(f"\n{'measure, on ' + cpu:<60}{'figure':>8}  {'floor':<7} verdict")
    for row in result["verdicts"]:
        figure = f"{row['figure']:.3f}" if row["figure"] is not None else "n/a"
        print(f"{row['measure']:<60}{figure:>8}  {row['floor']:<7} {'PASS' if row['ok'] else 'BELOW'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode in part 1 (ABBA)")
    parser.add_argument("--steps", type=int, default=30, help="steps of each job in part 1")
    parser.add_argument("--seconds", type=float, default=15.0, help="a measured window in part 2")
    parser.add_argument("--warmup", type=float, default=2.0, help="before each window in part 2")
    parser.add_argument("--clients", type=int, default=2, help="closed-loop clients in part 2 (1-4)")
    parser.add_argument(
        "--quick", action="store_true", help="1 round of 8 steps, 5 s windows, no warm-up job"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "share.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.seconds, args.warmup = 1, 8, 5.0, 1.0

    tmp = Path(tempfile.mkdtemp(prefix="share-"))
    env = {
        "GPUFORGE_CPU_SLOTS": "1",
        "GPUFORGE_DATA_ROOTS": str(ROOT / "examples"),
        # the server, its runners and replicas import this checkout's gpuforge, whatever is installed
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
    }
    began = time.monotonic()
    result = {"cpu": cpu_model_name(), "cores": len(os.sched_getaffinity(0))}
    result["args"] = vars(args) | {"json": str(args.json)}
    print(f"{result['cpu']}, {result['cores']} cores; server log {tmp / 'server.log'}", flush=True)
    with LocalServer(tmp / "home", log=tmp / "server.log", **env) as server:
        bench = Bench(server)
        served = None
        if not args.quick:  # the disk cache and the imports warm before anything is timed
            served = bench.submit("warm-up", 2, 1.0)
            bench.wait_job(served, lambda j: j["state"] == "finished")
            print(f"warm-up job {served} done at {time.monotonic() - began:.0f} s", flush=True)
        print("1. two jobs: serial (devices 1) against side by side (devices 0.5)", flush=True)
        result["side_by_side"] = side_by_side(bench, args.rounds, args.steps)
        print("2. a half-slot replica, alone and beside a half-slot job", flush=True)
        served = served or result["side_by_side"]["runs"][0]["jobs"][0]["id"]
        half_step = result["side_by_side"]["side_by_side_median_step_s"]
        result["replica"] = beside_a_job(bench, served, half_step, args)
    result["verdicts"] = verdicts(result["side_by_side"], result["replica"])
    result["total_s"] = time.monotonic() - began
    report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['total_s']:.0f} s in all; every figure in {args.json}")


if __name__ == "__main__":
    main()
