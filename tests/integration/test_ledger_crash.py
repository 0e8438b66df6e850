"""The cost ledger across a server killed with SIGKILL mid-job: the job's process runs on while no server
watches, the restarted server re-attaches it and charges the time it was away once, and when the job ends
the ledger holds its process's running time (not twice any part of it), its rows from before the kill
as they were, and `gpuforge costs` sums the same ledger."""

import json
import os
import signal
import time

import httpx
import pytest
import yaml
from sqlalchemy import select

from gpuforge.server.local import LocalServer
from gpuforge.store.db import connect, session
from gpuforge.store.ledger import minute_of
from gpuforge.store.models import Job, LedgerEntry
from tests.helpers.cli import run_cli
from tests.helpers.jobs import runner_pid, wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow
RATE = 36.0  # $ an hour: a cent a second


def _ledger(engine, job_id: int) -> list[tuple]:
    with session(engine) as s:
        rows = s.scalars(
            select(LedgerEntry).where(LedgerEntry.subject == f"job:{job_id}").order_by(LedgerEntry.minute)
        )
        return [(e.minute, e.device_seconds, e.usd, e.key_id) for e in rows]


def test_a_server_killed_mid_job_charges_each_second_of_it_once(tmp_path, store_url):
    home = tmp_path / "home"
    env = {
        "GPUFORGE_CPU_SLOTS": "1",
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_DB": store_url,
    }
    server = LocalServer(home, log=tmp_path / "server.log", **env).start()
    engine = connect(store_url)
    http = httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {server.key}"})
    job_id = None
    try:
        spec = image_spec(tmp_path, max_steps=120, checkpoint_every=20, options={"sleep_s": 0.05})
        spec["cost"] = {"usd_per_hour": RATE}
        job_id = http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
        wait_for_job(http, job_id, lambda j: (j["step"] or 0) >= 20, timeout=120.0)

        server.kill()  # SIGKILL: between two ticks, or in one
        before = _ledger(engine, job_id)
        with session(engine) as s:
            mark = s.get(Job, job_id).accrued_at
        charged = sum(ds for _, ds, _, _ in before)
        assert before and charged > 0
        time.sleep(3.0)  # the job trains on, with no server to watch it

        server.start()  # the same store and port
        done = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), timeout=120.0)
        assert done["state"] == "finished" and done["restarts"] == 0  # re-attached, not started again
        after = _ledger(engine, job_id)
        with session(engine) as s:
            ended = s.get(Job, job_id)
        began, marked = ended.run_started_at.timestamp(), ended.accrued_at.timestamp()
        total = sum(ds for _, ds, _, _ in after)
        # every second from the process's start to the last mark, once: none twice, none lost, the crash
        # and the server's three seconds away included
        assert total == pytest.approx(marked - began, abs=1e-3), (total, marked - began, charged)
        # and that is the process's running time: its start to the tick that saw it gone
        assert total == pytest.approx(ended.finished_at.timestamp() - began, abs=2.0)
        events = [json.loads(line) for line in open(f"{done['run_dir']}/events.jsonl")]
        trained = next(e["ts"] for e in events if e["event"] == "finished") - began  # on the runner's clock
        assert trained - 0.5 < total < trained + 10, (total, trained)  # its exit after its last word is slow
        assert sum(usd for _, _, usd, _ in after) == pytest.approx(total * RATE / 3600)
        assert {key for *_, key in after} == {1}  # the admin key, the job's owner

        # what was committed before the kill stands: earlier minutes as they were, the last one grew on
        same = [row for row in before if row[0] < minute_of(mark)]
        assert after[: len(same)] == same
        assert all(a[1] >= b[1] for a, b in zip(after[len(same) :], before[len(same) :], strict=False))

        answer = run_cli(
            "costs", "--by", "key", "--json", timeout=60,
            env={"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key},
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        costs = json.loads(answer.stdout)
        assert costs["total_device_hours"] == pytest.approx(total / 3600)
        assert [(g["key"], g["jobs"]) for g in costs["groups"]] == [("admin", 1)]
        table = run_cli("costs", env={"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key}, timeout=60)
        assert table.returncode == 0 and "total" in table.stdout, table.stderr
    finally:
        server.stop()
        engine.dispose()
        pid = runner_pid(str(home / "runs" / f"job-{job_id}")) if job_id else None
        if pid:
            os.kill(pid, signal.SIGKILL)
