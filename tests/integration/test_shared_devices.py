"""Issue 42 on a real server: two jobs asking for half of the one CPU slot run side by side, each pinned to
cores of its own (the runner's affinity says so, the job's record names them), niced below serving; the
ledger charges each half a device's time, and the energy the server estimated from the CPU's watts,
priced at its usd_per_kwh in place of the hourly energy part (never both) and with its CO2e; the runner's
metrics carry step_energy_j with its source."""

import json
import os
from pathlib import Path

import httpx
import pytest
import yaml
from sqlalchemy import func, select

from gpuforge.runtime.host import usable_cores
from gpuforge.server.local import LocalServer
from gpuforge.store.db import connect, session
from gpuforge.store.models import LedgerEntry
from tests.helpers.cli import run_cli
from tests.helpers.jobs import runner_pid, wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow
WATTS, USD_PER_KWH, GRID = 100.0, 0.5, 400.0
PURCHASE_PER_HOUR = 1.0  # 8760 $ written off over one year at full use


def _ledger(engine, job_id: int) -> tuple[float, float, float, float]:
    with session(engine) as s:
        usd, seconds, kwh, co2e = s.execute(
            select(
                func.sum(LedgerEntry.usd),
                func.sum(LedgerEntry.device_seconds),
                func.sum(LedgerEntry.kwh),
                func.sum(LedgerEntry.co2e_g),
            ).where(LedgerEntry.subject == f"job:{job_id}")
        ).one()
    return float(usd or 0), float(seconds or 0), float(kwh or 0), float(co2e or 0)


def test_two_half_slot_jobs_run_side_by_side_pinned_and_are_charged_their_half_and_their_energy(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    price = {"purchase_usd": 8760.0, "years": 1, "watts": WATTS, "usd_per_kwh": USD_PER_KWH}
    (home / "prices.yaml").write_text(yaml.safe_dump({"cpu": price}))
    env = {
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_ALLOW_USER_CODE": "true",
        "GPUFORGE_GRID_GCO2E_PER_KWH": str(GRID),
    }
    with LocalServer(home, log=tmp_path / "server.log", **env) as server:
        http = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"}
        )
        as_admin = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key}
        ids = []
        for name in ("left", "right"):
            spec = image_spec(tmp_path, max_steps=40, options={"sleep_s": 0.05})
            spec |= {"name": name, "resources": {"devices": 0.5}}
            submitted = run_cli(
                "submit", str(write_spec(tmp_path / f"{name}.yaml", spec)), "--json", env=as_admin
            )
            assert submitted.returncode == 0, submitted.stderr
            ids.append(json.loads(submitted.stdout)["id"])
        both = [
            wait_for_job(http, i, lambda j: j["state"] == "running" and (j["step"] or 0) >= 1) for i in ids
        ]
        # both hold cpu:0 at once, each its share of its cores, pinned
        assert all(j["devices"] == "cpu:0" and j["device_share"] == 0.5 for j in both), both
        cores = [set(map(int, j["isolation"].split()[1].split(","))) for j in both]
        for job, own in zip(both, cores, strict=True):
            assert job["isolation"].startswith("cores "), job
            pid = runner_pid(job["run_dir"])
            assert pid is not None and os.sched_getaffinity(pid) == own, (job, pid)
            assert os.getpriority(os.PRIO_PROCESS, pid) == 10 and job["isolation"].endswith(", nice 10")
        if usable_cores() >= 2:
            assert not cores[0] & cores[1] and "shared" not in both[0]["isolation"], both
        ended = [wait_for_job(http, i, lambda j: j["state"] not in ("queued", "running")) for i in ids]
        engine = connect(f"sqlite:///{home / 'gpuforge.db'}")
        for job in ended:
            assert job["state"] == "finished", job
            # the hourly rate leaves the energy out: it is charged by the kWh measured instead
            assert job["usd_per_hour"] == pytest.approx(PURCHASE_PER_HOUR * 0.5)
            usd, seconds, kwh, co2e = _ledger(engine, job["id"])
            assert seconds > 0 and kwh > 0
            assert usd == pytest.approx(seconds * PURCHASE_PER_HOUR / 3600 + kwh * USD_PER_KWH, rel=1e-6)
            assert co2e == pytest.approx(kwh * GRID, rel=1e-6)
            assert job["energy_kwh"] == pytest.approx(kwh, rel=1e-6) and job["co2e_g"] == pytest.approx(co2e)
            assert (
                job["energy_source"].startswith("estimated: ") and "prices.yaml cpu" in job["energy_source"]
            )
            # at most its cores' share of the CPU's watts, over the time it held them
            share_of_cpu = len(cores[ended.index(job)]) / usable_cores()
            assert kwh * 3.6e6 <= WATTS * share_of_cpu * (seconds / 0.5) * 1.05
            lines = Path(job["run_dir"], "metrics.jsonl").read_text().splitlines()
            energies = [json.loads(x) for x in lines if "step_energy_j" in x]
            assert energies and all(e["energy_source"].startswith("estimated: ") for e in energies)
            summary = json.loads(Path(job["run_dir"], "summary.json").read_text())  # the run's own figure
            assert summary["energy_j"] > 0 and summary["energy_source"].startswith("estimated: ")
        costs = http.get("/api/v1/costs").json()
        assert costs["total_kwh"] == pytest.approx(sum(_ledger(engine, i)[2] for i in ids), rel=1e-6)
        shown = run_cli("costs", env=as_admin)
        assert shown.returncode == 0 and "kWh" in shown.stdout and "gCO2e" in shown.stdout, shown.stdout
