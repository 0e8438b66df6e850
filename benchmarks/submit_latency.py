"""From `gpuforge submit` to the job's first training step, through a real server on loopback, by phase.

    python benchmarks/submit_latency.py [--rounds 3] [--spec examples/digits-cnn.yaml]

A `gpuforge server` process (a temporary GPUFORGE_HOME, SQLite, one CPU slot) gets the spec (3 steps, no
eval, no compression) `--rounds` times, one job after the other; the client polls the job's metrics
every 10 ms until step 1 is there. Phases, all on this machine's clock:
  submit       the client's POST (and the upload of the files the spec names, the first time)
  queued       the server's record: submitted to launched (the scheduler wakes on a submit)
  runner start the new process: Python, torch and gpuforge imports, before the run's set-up
  set-up       device, data, model, batch size (the runner's `setup_s`): the model load, excluded below
  first step   set-up done to step 1 in metrics.jsonl (FLOP probe, the step, its line)
Floor (issue 5): submit to first step under 5 s for a small job, model load excluded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402

FLOOR_S = 5.0
PHASES = ("submit", "queued", "runner start", "set-up", "first step")


def one_round(client, spec) -> dict[str, float]:
    t0 = time.time()
    job_id = client.submit(spec)["id"]
    submitted = time.time()
    while not client.metrics(job_id, limit=1):
        time.sleep(0.01)
    first_step = time.time()
    while not (started := [e for e in client.events(job_id) if e["kind"] == "started"]):
        time.sleep(0.05)  # events reach the store at the scheduler's next tick
    started = started[0]
    job = client.job(job_id)
    created, launched = (datetime.fromisoformat(job[k]).timestamp() for k in ("created_at", "started_at"))
    setup = started["data"]["setup_s"]
    while client.job(job_id)["state"] in ("queued", "running"):  # the next round starts on a free slot
        time.sleep(0.05)
    return {
        "submit": submitted - t0,
        "queued": launched - created,
        "runner start": started["ts"] - setup - launched,
        "set-up": setup,
        "first step": first_step - started["ts"],
        "total": first_step - t0,
        "total less set-up": first_step - t0 - setup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "digits-cnn.yaml")
    args = parser.parse_args()
    overrides = ["train.max_steps=3", "train.eval_every=1000"]
    overrides += ["compress.prune=null", "compress.quantize=null"]
    spec = load_spec(args.spec, overrides)
    with tempfile.TemporaryDirectory(prefix="gpuforge-submit-") as tmp:
        with LocalServer(Path(tmp) / "home", log=Path(tmp) / "server.log", GPUFORGE_CPU_SLOTS="1") as server:
            client = server.client()
            rounds = [one_round(client, spec) for _ in range(args.rounds)]
    print(f"{args.spec.name}, 3 steps, {args.rounds} rounds (seconds; round 1 also uploads the spec's files)")
    heads = "".join(f"{f'round {i + 1}':>10}" for i in range(args.rounds))
    print(f"{'phase':<20}{heads}{'median':>10}")
    for phase in (*PHASES, "total", "total less set-up"):
        values = [r[phase] for r in rounds]
        cells = "".join(f"{v:>10.3f}" for v in values)
        print(f"{phase:<20}{cells}{statistics.median(values):>10.3f}")
    worst = max(r["total less set-up"] for r in rounds)
    verdict = "PASS" if worst < FLOOR_S else "BELOW"
    print(f"submit to first step, model load excluded: worst {worst:.2f} s  floor < {FLOOR_S:g} s  {verdict}")


if __name__ == "__main__":
    main()
