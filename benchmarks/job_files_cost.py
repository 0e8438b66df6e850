"""What a job's own files and a bad spec cost the team server (issue 35): memory and CPU, measured.

    python benchmarks/job_files_cost.py [--gib 1] [--seconds 120]

One `gpuforge server` on loopback (LocalServer, a temporary home, one CPU slot), and:
  metrics  a script job (admin key) writes --gib of metrics lines to its metrics.jsonl as fast as the disk
           takes them, then sleeps; the server's resident memory (/proc/<pid>/status VmRSS, and VmHWM, its
           peak, reset first) is sampled while it ingests, until it has read the whole file or --seconds
           pass. Floor: the peak within 100 MiB of the RSS before the job started.
  spec     POST /api/v1/jobs with a 240 KB spec of 24,000 unknown keys, beside one with a single unknown
           key, 5 times each: the server process's CPU time (utime + stime, /proc/<pid>/stat) each took,
           and the answer's size. Floor: the 24,000-key spec under 50 ms of server CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from unauthenticated_body_memory import status_kib  # noqa: E402  (its /proc reader)

from gpuforge.client import Client  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import parse_spec  # noqa: E402
from gpuforge.store.db import connect, session  # noqa: E402
from gpuforge.store.models import Job  # noqa: E402

MIB = 1 << 20
WRITER = """
import os, sys
line = b'{"step": 1, "loss": 0.5, "lr": 0.001, "samples_per_s": 100.0, "step_time_s": 0.01, "pad": "%s"}\\n'
block = (line % (b"x" * 40)) * ((1 << 20) // len(line))
path = os.path.join(os.environ["GPUFORGE_RUN_DIR"], "metrics.jsonl")
left = int(float(sys.argv[1]) * (1 << 30))
with open(path, "ab") as f:
    while left > 0:
        f.write(block)
        left -= len(block)
open(os.path.join(os.environ["GPUFORGE_RUN_DIR"], "written"), "w").write(str(os.path.getsize(path)))
import time; time.sleep(3600)
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics_memory(server: LocalServer, http: httpx.Client, tmp: Path, gib: float, seconds: float) -> dict:
    pid = server.process.pid
    work = tmp / "writer"
    work.mkdir()
    (work / "write.py").write_text(WRITER)
    spec = {"name": "writer", "kind": "script", "script": {"command": f"python write.py {gib}",
            "files": ["write.py"], "workdir": str(work)}}  # fmt: skip
    before = status_kib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    job = Client(server.url, server.key).submit(parse_spec(spec, work))  # the CLI's: it sends the files
    run = Path(job["run_dir"])
    started, written, peak, read = time.monotonic(), None, before, 0
    while time.monotonic() - started < seconds:
        time.sleep(1.0)
        peak = max(peak, status_kib(pid, "VmHWM"))
        if written is None and (run / "written").exists():
            written = int((run / "written").read_text())
        engine = connect(f"sqlite:///{server.home / 'gpuforge.db'}")
        with session(engine) as s:
            read = s.get(Job, job["id"]).metrics_offset
        engine.dispose()
        if written is not None and read >= written:
            break
    http.post(f"/api/v1/jobs/{job['id']}/cancel")
    growth = (peak - before) / 1024
    took = time.monotonic() - started
    return {"written MiB": (written or 0) / MIB, "read MiB": read / MIB, "seconds": took,
            "rss before MiB": before / 1024, "peak MiB": peak / 1024, "growth MiB": growth}  # fmt: skip


def spec_cpu(server: LocalServer, http: httpx.Client) -> list[dict]:
    base = {"name": "x", "model": {"source": "bundled:minilm", "task": "sequence-classification"},
            "data": {"train": "sklearn:digits"}}  # fmt: skip
    specs = {
        "24,000 unknown keys": yaml.safe_dump({**base, "train": {f"{i:x}": 1 for i in range(24_000)}}),
        "1 unknown key": yaml.safe_dump({**base, "train": {"lrr": 1}}),
    }
    rows = []
    for name, text in specs.items():
        times, sizes, codes = [], [], set()
        for _ in range(5):
            before = cpu_s(server.process.pid)
            answer = http.post("/api/v1/jobs", json={"spec": text})
            time.sleep(0.05)  # the answer is sent before the request's last cycles are counted
            times.append(cpu_s(server.process.pid) - before)
            sizes.append(len(answer.content))
            codes.add(answer.status_code)
        rows.append({"spec": name, "bytes": len(text), "status": sorted(codes), "server cpu ms (median)":
                     sorted(times)[2] * 1000, "answer bytes": max(sizes)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuforge-files-") as tmp:
        tmp = Path(tmp)
        with LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_CPU_SLOTS="1") as server:
            http = httpx.Client(
                base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.key}"}
            )
            for row in spec_cpu(server, http):
                verdict = (
                    "PASS"
                    if row["spec"] != "24,000 unknown keys" or row["server cpu ms (median)"] < 50
                    else "BELOW"
                )
                print(f"spec: {row} {verdict}")
            memory = metrics_memory(server, http, tmp, args.gib, args.seconds)
            verdict = "PASS" if memory["growth MiB"] <= 100 else "BELOW"
            print(f"metrics: {memory} {verdict}")


if __name__ == "__main__":
    main()
