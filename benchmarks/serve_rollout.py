"""A deployment's life under load, through `gpuforge server` on loopback: a new version rolled out while
clients send requests, scaling up under the load and down to zero after it, and the cold start of the
request that wakes it.

    python benchmarks/serve_rollout.py [--clients 8] [--steps 10] [--seconds 20] [--json out.json]

The model: the MiniLM topic classifier of examples/minilm-topics.yaml, trained twice through the server
(`--steps` steps in fp32, seeds 0 and 1: v1 and v2). The server has two CPU slots. The deployment: min 0,
max 2 replicas, target_queue 2, scale_down_after_s 5, max_metric_drop 0.5 (two short runs differ by a few
points; the check itself is tested in tests/server/test_deployment_rollout.py).

The load: `--clients` threads in closed loop, each its own keep-alive connection, one sentence of
examples/data/topics.jsonl a request, through the server's address (the forwarder). Phases:
  steady      `--seconds` on v1 (the autoscaler may add the second replica);
  rollout     v2 deployed on the name; the load goes on until v2 serves, then 2 s more;
  idle        no request until the deployment has scaled to zero (replicas 0, no process);
  wake        one request: its latency (held while a replica starts) and the cold_start event.
Printed: per phase, requests, answers by status, req/s, p50 and p99; the rollout's duration (from the
deploy call to the `rolled_out` event), the versions that answered in order (each client's sequence must
change once), every scaling event with its reason, and the cold start. No floor is judged here: the
issue's floor is zero failed requests during the rollout, and the table says whether it held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from gpuforge.server.local import LocalServer

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "minilm-topics.yaml"
SENTENCES = [
    json.loads(line)["text"]
    for line in (ROOT / "examples" / "data" / "topics.jsonl").read_text().splitlines()
]


def wait_for(http: httpx.Client, path: str, until, timeout: float = 900.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = http.get(path).json()
        if until(found):
            return found
        time.sleep(0.25)
    raise RuntimeError(f"{path}: not there after {timeout:g} s")


class Load:
    """Closed-loop clients; each answer as (sent, answered, status, version), per client."""

    def __init__(self, url: str, headers: dict, name: str, clients: int):
        self.url, self.headers, self.name = url, headers, name
        self.answers: list[list[tuple[float, float, int, str | None]]] = [[] for _ in range(clients)]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as http:
            n = i * 37
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    answer = http.post(f"/api/v1/deployments/{self.name}/predict",
                                       json={"inputs": [SENTENCES[n % len(SENTENCES)]]})  # fmt: skip
                    status, version = answer.status_code, answer.headers.get("x-gpuforge-version")
                except httpx.HTTPError as err:
                    status, version = type(err).__name__, None
                self.answers[i].append((sent, time.monotonic(), status, version))
                n += 1

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def between(self, t0: float, t1: float) -> list[tuple]:
        return [a for answers in self.answers for a in answers if t0 <= a[1] < t1]


def phase(name: str, answers: list[tuple], seconds: float) -> dict:
    ok = sorted(1000 * (a[1] - a[0]) for a in answers if a[2] == 200)
    return {
        "phase": name,
        "requests": len(answers),
        "statuses": dict(Counter(str(a[2]) for a in answers)),
        "req_per_s": len(ok) / seconds if seconds else 0.0,
        "p50_ms": statistics.median(ok) if ok else None,
        "p99_ms": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None,
        "seconds": seconds,
    }


def train_two(client, http) -> list[int]:
    from gpuforge.spec import load_spec

    ids = []
    for seed in (0, 1):
        overrides = [f"train.max_steps={ARGS.steps}", "train.precision=fp32", f"train.seed={seed}"]
        ids.append(client.submit(load_spec(SPEC, overrides))["id"])
    started = time.monotonic()
    for job_id in ids:
        job = wait_for(
            http, f"/api/v1/jobs/{job_id}", lambda j: j["state"] in ("finished", "failed", "cancelled")
        )
        if job["state"] != "finished":
            raise RuntimeError(f"job {job_id} {job['state']}: {job.get('reason')}")
    print(f"trained v1 and v2 (jobs {ids}) in {time.monotonic() - started:.0f} s", flush=True)
    return ids


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="serve-rollout-"))
    server = LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_CPU_SLOTS="2",
                         GPUFORGE_DATA_ROOTS=str(ROOT / "examples"))  # fmt: skip
    with server:
        headers = {"Authorization": f"Bearer {server.key}"}
        http = httpx.Client(base_url=server.url, headers=headers, timeout=120)
        v1, v2 = train_two(server.client(), http)
        body = {"job_id": v1, "name": "topics", "min_replicas": 0, "max_replicas": 2, "target_queue": 2,
                "scale_down_after_s": 5, "max_metric_drop": 0.5}  # fmt: skip
        made = http.post("/api/v1/deployments", json=body)
        made.raise_for_status()
        began = time.monotonic()
        wait_for(http, "/api/v1/deployments/topics", lambda d: d["state"] == "ready")
        print(f"v1 ready in {time.monotonic() - began:.1f} s (its replica measures the metric at load)")

        load = Load(server.url, headers, "topics", ARGS.clients).start()
        t0 = time.monotonic()
        time.sleep(ARGS.seconds)
        t1 = time.monotonic()
        rolled = http.post("/api/v1/deployments", json={"job_id": v2, "name": "topics"})
        rolled.raise_for_status()
        wait_for(http, "/api/v1/deployments/topics/versions",
                 lambda vs: vs[0]["version"] == 2 and vs[0]["state"] != "rolling")  # fmt: skip
        t2 = time.monotonic()
        time.sleep(2.0)
        load.finish()
        t3 = time.monotonic()
        phases = [phase("steady (v1)", load.between(t0, t1), t1 - t0),
                  phase("rollout v1 -> v2", load.between(t1, t3), t3 - t1)]  # fmt: skip

        wait_for(http, "/api/v1/deployments/topics", lambda d: d["replicas"] == 0 and not d["workers"])
        t4 = time.monotonic()
        woke_sent = time.monotonic()
        woke = http.post("/api/v1/deployments/topics/predict", json={"inputs": [SENTENCES[0]]})
        wake_ms = 1000 * (time.monotonic() - woke_sent)
        events = http.get("/api/v1/deployments/topics/events").json()
        versions = http.get("/api/v1/deployments/topics/versions").json()
        http.delete("/api/v1/deployments/topics")
        wait_for(http, "/api/v1/deployments/topics", lambda d: d["state"] == "stopped", 120)

    changes = []
    for answers in load.answers:
        seen = [a[3] for a in answers if a[2] == 200]
        changes.append(sum(1 for a, b in zip(seen, seen[1:], strict=False) if a != b))
    rolled_at = next((e["ts"] for e in events if e["kind"] == "rolled_out"), None)
    asked_at = next((e["ts"] for e in events if e["kind"] == "rolling"), None)
    result = {
        "clients": ARGS.clients,
        "phases": phases,
        "rollout_s": (rolled_at - asked_at) if rolled_at and asked_at else None,
        "version_changes_per_client": changes,
        "idle_to_zero_s": t4 - t3,
        "wake": {
            "status": woke.status_code,
            "latency_ms": wake_ms,
            "held_ms": woke.headers.get("x-gpuforge-held-ms"),
        },  # fmt: skip
        "cold_start_s": [e["data"]["seconds"] for e in events if e["kind"] == "cold_start"],
        "events": events,
        "versions": [{k: v[k] for k in ("version", "state", "metric", "reason")} for v in versions],
        "rollout_wait_s": t2 - t1,
    }
    report(result)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(result, indent=1))


def report(r: dict) -> None:
    print(
        f"\nserve rollout: {r['clients']} clients in closed loop through the server's forwarder, 2 CPU slots"
    )
    print(f"{'phase':<20}{'requests':>9}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}  answers")
    for p in r["phases"]:
        print(f"{p['phase']:<20}{p['requests']:>9}{p['req_per_s']:>8.1f}{p['p50_ms'] or 0:>9.1f}"
              f"{p['p99_ms'] or 0:>9.1f}  {p['statuses']}")  # fmt: skip
    failed = sum(n for p in r["phases"] for s, n in p["statuses"].items() if s != "200")
    print(
        f"rollout: {r['rollout_s']:.1f} s from the deploy call to `rolled_out`; failed requests: {failed}; "
        f"version changes per client: {r['version_changes_per_client']}"
    )
    for v in r["versions"]:
        metric = v["metric"] or {}
        print(f"  v{v['version']}: {v['state']}, {metric.get('metric')} {metric.get('value')}")
    for e in r["events"]:
        if e["kind"] in ("scaled", "cold_start"):
            print(f"  {e['kind']}: {e['data']}")
    print(
        f"idle -> zero replicas: {r['idle_to_zero_s']:.1f} s; the waking request: {r['wake']['status']} in "
        f"{r['wake']['latency_ms']:.0f} ms (held {r['wake']['held_ms']} ms); cold start {r['cold_start_s']} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json")
    ARGS = parser.parse_args()
    main()
