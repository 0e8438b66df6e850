"""executors.build picks the executor once from the settings (the server's and a runner's alike), and each
executor answers the protocol's questions: what it refuses before the server listens, its devices, and
(Slurm) which spans the ledger charges a running job within."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import pytest

from gpuforge.errors import GpuforgeError
from gpuforge.executors import build
from gpuforge.executors.local import LocalExecutor
from gpuforge.executors.ray_actors import RayExecutor
from gpuforge.executors.slurm_jobs import SlurmExecutor
from gpuforge.runs import RunDir
from gpuforge.server.settings import Settings
from gpuforge.settings import current
from gpuforge.store.models import Job


@pytest.mark.parametrize(
    "kind, built, launches_ranks, rereads_devices",
    [
        ("local", LocalExecutor, False, False),
        ("ray", RayExecutor, True, False),
        ("slurm", SlurmExecutor, True, True),
    ],
)
def test_the_server_and_its_runners_build_the_executor_the_setting_names(
    tmp_path, kind, built, launches_ranks, rereads_devices
):
    server_side = build(Settings(home=tmp_path, executor=kind), tmp_path / "runs")
    runner_side = build(current({"GPUFORGE_EXECUTOR": kind, "GPUFORGE_HOME": str(tmp_path)}))
    for executor in (server_side, runner_side):
        assert type(executor) is built
        assert (executor.launches_ranks, executor.rereads_devices) == (launches_ranks, rereads_devices)


@pytest.mark.parametrize(
    "given, said",
    [
        (
            {"slurm_partition": "debug"},
            "GPUFORGE_SLURM_PARTITION: for --executor slurm (this server's is local)",
        ),
        (
            {"executor": "ray", "ray_address": "head:6379", "slurm_account": "a", "slurm_qos": "q"},
            "GPUFORGE_SLURM_ACCOUNT, GPUFORGE_SLURM_QOS: for --executor slurm (this server's is ray)",
        ),
        ({"executor": "ray"}, "--executor ray needs --ray-address HOST:PORT (the head node of the cluster)"),
    ],
)
def test_the_check_before_listening_refuses_options_that_do_not_fit_in_one_line(tmp_path, given, said):
    executor = build(Settings(home=tmp_path, **given), tmp_path / "runs")
    with pytest.raises(GpuforgeError) as refused:
        executor.check()
    assert str(refused.value) == said


def test_a_local_executor_hands_out_this_machines_devices_with_their_labels(tmp_path):
    devices = build(Settings(home=tmp_path, device_labels="site=lab")).devices()
    assert devices and all(dict(d.labels) == {"site": "lab"} for d in devices)
    assert LocalExecutor().check() is None  # nothing to ask before listening
    with pytest.raises(GpuforgeError, match="GPUFORGE_DEVICE_LABELS"):
        build(Settings(home=tmp_path, device_labels="site")).devices()


def test_a_local_run_is_charged_whole_from_its_runners_start(tmp_path):
    began = datetime.now(UTC)
    job = Job(id=1, run_dir=str(tmp_path / "run"), pid=os.getpid(), run_started_at=began)
    executor = LocalExecutor()
    executor.take_stock([job])
    assert executor.runs_to_charge(job.id) is None
    assert executor.holds_devices_since(job) == began


def _job(tmp_path, job_id: int, pid: int, began: datetime) -> Job:
    run = RunDir(tmp_path / f"run{job_id}")
    run.create()
    run.logs_dir.mkdir(parents=True, exist_ok=True)
    return Job(id=job_id, run_dir=str(run.root), pid=pid, run_started_at=began)


def test_a_slurm_job_is_charged_while_its_slurm_jobs_ran_as_its_runner_wrote_and_the_server_saw(tmp_path):
    began = datetime.now(UTC) - timedelta(minutes=10)
    ran_from = began + timedelta(minutes=2)
    ran_to = ran_from + timedelta(minutes=3)
    marked, waiting, forged = (_job(tmp_path, n, os.getpid(), began) for n in (1, 2, 3))
    marks = f"{os.getpid()} {ran_from.timestamp()}:{ran_to.timestamp()}"  # as launch/slurm.py's RunningMarks
    RunDir(marked.run_dir).slurm_running_path.write_text(marks)
    # another pid's marks (an earlier runner's, or the job's own ranks'): not its runner's word
    RunDir(forged.run_dir).slurm_running_path.write_text(f"{os.getpid() + 1} {began.timestamp()}:")
    holding = {str(RunDir(forged.run_dir).logs_dir)}  # but squeue shows it holding its nodes now
    executor = SlurmExecutor({}, holding_source=lambda: holding)
    executor.seen_holding.read()
    executor.take_stock([marked, waiting, forged])

    (span,) = executor.runs_to_charge(marked.id)
    assert abs((span[0] - ran_from).total_seconds()) < 1e-3 and abs((span[1] - ran_to).total_seconds()) < 1e-3
    assert executor.holds_devices_since(marked) == span[0]  # its max_time counts from its first run
    assert executor.runs_to_charge(waiting.id) == []  # in Slurm's queue: charged nothing yet
    assert executor.holds_devices_since(waiting) is None
    (seen,) = executor.runs_to_charge(forged.id)  # what the server saw, from its own read on, still open
    assert seen[0] >= began and seen[1] is None
    assert executor.holds_devices_since(Job(id=4, run_started_at=None)) is None  # claimed, not started
