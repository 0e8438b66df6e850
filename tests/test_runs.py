import json
import os

import pytest

from gpuforge.errors import RunDirError
from gpuforge.runs import SLURM_RUNS_BYTES, SLURM_RUNS_KEPT, RunDir, SlurmRuns, read_jsonl


def test_events_and_metrics_are_json_lines_and_nan_becomes_null(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    run.event("started", step=0)
    run.metric({"step": 1, "loss": float("nan")})
    assert [e["event"] for e in run.events()] == ["started"]
    assert run.metrics() == [{"step": 1, "loss": None}]
    with pytest.raises(AssertionError):
        run.event("exploded")


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]


def test_truncate_metrics_after_a_resume_point(tmp_path):
    run = RunDir(tmp_path)
    run.create()
    for step in range(1, 8):
        run.metric({"step": step})
    run.truncate_metrics_after(4)
    assert [m["step"] for m in run.metrics()] == [1, 2, 3, 4]


def test_only_complete_checkpoints_count(tmp_path):
    run = RunDir(tmp_path)
    run.create()
    for step, complete in ((5, True), (10, True), (15, False)):
        path = run.checkpoint_path(step)
        path.mkdir()
        if complete:
            (path / "meta.json").write_text("{}")
    assert [s for s, _ in run.checkpoints()] == [5, 10]
    assert run.latest_checkpoint()[0] == 10


def test_check_usable_refuses_files_and_foreign_directories(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        RunDir(afile).check_usable()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="holds no gpuforge run"):
        RunDir(foreign).check_usable()
    RunDir(tmp_path / "new").check_usable()  # absent: fine


def test_the_slurm_launchers_running_marks_read_back_as_its_pid_and_its_runs(tmp_path):
    from gpuforge.launch.slurm import RunningMarks

    run = RunDir(tmp_path / "run")
    run.create()
    run.logs_dir.mkdir(parents=True, exist_ok=True)
    marks = RunningMarks(run)
    marks(False)  # ended before it ever ran: nothing to charge, no file
    assert run.slurm_runs() is None and not run.slurm_running_path.exists()
    marks(True)
    marks(True)  # no change
    seen = run.slurm_runs()
    assert seen.runner_pid == os.getpid() and len(seen.runs) == 1 and seen.runs[0][1] is None
    marks(False)  # requeued into Slurm's queue: it waits
    marks(True)
    first, again = run.slurm_runs().runs
    assert first[0] <= first[1] <= again[0] and again[1] is None
    for _ in range(SLURM_RUNS_KEPT):  # many requeues: the first run and the latest are kept
        marks(False)
        marks(True)
    kept = run.slurm_runs().runs
    assert len(kept) == SLURM_RUNS_KEPT and kept[0] == first and kept[-1][1] is None
    assert run.slurm_running_path.stat().st_size <= SLURM_RUNS_BYTES


@pytest.mark.parametrize(
    "written",
    ["", "7", "soon 1.5:", "7 1.5", "7 nan:", "7 inf:2", "7 1.5:1.0", "7 1.5: 2.0:", "7 1.5:3 2.0:", "7 x:"],
)
def test_a_slurm_running_file_the_launcher_did_not_write_reads_as_no_run(tmp_path, written):
    run = RunDir(tmp_path / "run")
    run.create()
    run.logs_dir.mkdir(parents=True, exist_ok=True)
    run.slurm_running_path.write_text(written)
    assert run.slurm_runs() is None
    run.slurm_running_path.write_text("7 1.5:2.5 3.0:")
    assert run.slurm_runs() == SlurmRuns(7, ((1.5, 2.5), (3.0, None)))
