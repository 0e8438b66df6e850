"""Script jobs (kind: script): the team's own command, run with a run directory, metrics through
gpuforge.track, cost and budget, stop signals with a grace period, and resume from its own checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for_job
from tests.helpers.specs import write_spec

# a training loop of the kind a team already has: its own steps, metrics through track, a checkpoint
# when asked to stop, and a resume from it
LOOP = """
import sys, time
from gpuforge import track

steps = int(sys.argv[1])
start = track.resume_step()
print("starting at", start, flush=True)
# a pause per step asked for holds the first attempt only: a resumed one has had the stop it waited for
pause = float(sys.argv[2]) if len(sys.argv) > 2 and not start else 0.01
for step in range(start, steps):
    time.sleep(pause)
    track.log(step, loss=1.0 / (step + 1), accuracy=step / steps)
    if track.should_stop():
        (track.checkpoint_dir() / "state.txt").write_text(str(step))
        track.checkpointed(step)
        print("saved at", step, flush=True)
        sys.exit(0)
print("done", flush=True)
"""


def _job(tmp_path: Path, command: str, files=("loop.py",), **sections) -> Path:
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "loop.py").write_text(LOOP)
    script = {"command": command, "files": list(files), **sections.pop("script", {})}
    return write_spec(work / "job.yaml", {"name": "loop", "kind": "script", "script": script, **sections})


def _stopped_after(args: list[str], run: Path, lines: int, timeout: float = 120) -> tuple[int, str, str]:
    """Run `gpuforge ARGS`, SIGTERM it once its run directory holds `lines` metrics lines; how it ended."""
    cmd = [sys.executable, "-m", "gpuforge", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < lines:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def _log_tail(run: Path, lines: int = 60) -> str:
    """The end of what the script and its ranks printed (a rank's own traceback or abort message, which
    torchrun's report leaves out)."""
    log = run / "logs" / "script.log"
    shown = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else ["(no script.log)"]
    return "\n--- logs/script.log ---\n" + "\n".join(shown)


def _processes_of(run: Path) -> list[int]:
    """The processes working for the run directory `run` (its runner, and what it started)."""
    mark, found = f"{run}".encode(), []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes() or mark in (environ.parent / "cmdline").read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_a_script_runs_in_its_folder_and_reports_metrics_cost_and_a_summary(tmp_path):
    spec = _job(tmp_path, "python loop.py 6", cost={"usd_per_hour": 3.6})
    run = tmp_path / "run"
    result = run_cli("train", str(spec), "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "finished: 6 steps reported" in result.stdout and "done" in result.stdout  # its output, live
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6)) and metrics[-1]["loss"] == pytest.approx(1 / 6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["kind"] == "script" and summary["exit_code"] == 0
    assert summary["steps"] == 6 and summary["final_loss"] == pytest.approx(1 / 6)
    assert summary["cost_usd"] == pytest.approx(summary["wall_s"] / 3600 * 3.6)
    assert "done" in (run / "logs" / "script.log").read_text()
    started = _events(run)[0]
    assert started["event"] == "started" and started["how"] == "starts from the beginning"
    assert started["command"][0] == sys.executable  # `python`: gpuforge's own interpreter
    assert "kind: script" in (run / "spec.yaml").read_text()


@pytest.mark.slow
def test_sigterm_saves_through_track_and_the_same_command_resumes_from_that_checkpoint(tmp_path):
    spec = _job(tmp_path, "python loop.py 400 0.02")
    run = tmp_path / "run"
    returncode, out, err = _stopped_after(["train", str(spec), "--out", str(run)], run, lines=5)
    assert returncode == 143, err
    assert "cancelled" in out and "SIGTERM received" in out
    saved = int((run / "checkpoints" / "script" / "state.txt").read_text())
    assert [e["event"] for e in _events(run)] == ["started", "checkpoint", "cancelled"]

    again = run_cli(
        "train", str(spec.parent / "job.yaml"), "--out", str(run), "--set", "script.command=python loop.py 40"
    )
    assert again.returncode == 2 and "holds a run of a different spec" in again.stderr  # the same job only
    resumed = run_cli("train", str(spec), "--out", str(run), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"starting at {saved + 1}" in resumed.stdout
    events = _events(run)
    assert events[-2]["event"] == "started" and events[-2]["resumes_from"] == saved + 1
    assert events[-2]["how"] == "resumes from its checkpoint"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(400))  # each step once: nothing lost, nothing twice


@pytest.mark.slow
def test_a_script_that_ignores_the_stop_is_killed_after_its_grace_and_a_budget_pauses_it(tmp_path):
    stubborn = tmp_path / "work" / "stubborn.py"
    stubborn.parent.mkdir()
    stubborn.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n"
    )
    spec = _job(
        tmp_path,
        "python stubborn.py",
        files=["stubborn.py"],
        script={"stop_grace_s": 1},
        cost={"usd_per_hour": 3600, "budget_usd": 3.0},  # a dollar a second: spent in 3 s
    )
    start = time.monotonic()
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"), timeout=60)
    assert time.monotonic() - start < 20
    assert result.returncode == 3, result.stderr  # paused, as a spec job over its budget
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "paused" and summary["reason"] == "cost.budget_usd 3 spent"
    assert summary["exit_code"] == -signal.SIGKILL and summary["metrics_reported"] is False
    assert (tmp_path / "run" / "stop").read_text() == "cost.budget_usd 3 spent"
    again = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert again.returncode == 2 and "cost.budget_usd: 3 spent already" in again.stderr  # not started again


CRASHING = """
import os, signal
from gpuforge import track

for step in range(track.resume_step(), 6):
    track.log(step, loss=1.0 / (step + 1))
    if step == 2:
        (track.checkpoint_dir() / "state.txt").write_text(str(step))
        track.checkpointed(step)
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would, on every attempt
"""


@pytest.mark.slow
def test_a_script_killed_by_a_signal_restarts_from_its_checkpoint_until_its_restarts_are_used(tmp_path):
    spec = _job(tmp_path, "python crashing.py", files=["crashing.py"], script={"max_restarts": 1})
    (spec.parent / "crashing.py").write_text(CRASHING)
    run = tmp_path / "run"
    result = run_cli("train", str(spec), "--out", str(run))
    assert result.returncode == 1, result.stderr
    assert "the script was killed by SIGKILL; restart 1 of 1: resumes from its checkpoint" in result.stdout
    events = _events(run)
    assert [e["event"] for e in events] == ["started", "checkpoint", "restarted", "failed"]
    assert events[0]["how"] == "starts from the beginning" and events[2]["resumes_from"] == 3
    assert events[-1]["reason"].startswith("the script was killed by SIGKILL, after 1 restart(s)")
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # 3 and 4 of the first attempt, past its checkpoint, logged once

    none = run_cli("train", str(spec), "--out", str(tmp_path / "once"), "--set", "script.max_restarts=0")
    assert none.returncode == 1 and "restart" not in " ".join(e["event"] for e in _events(tmp_path / "once"))


# torchrun's failure report (torch 2.13) for two ranks: rank 0 exited on its peer's death in the same
# second as rank 1 was killed, so torch names rank 0 the root cause
TORCHRUN_REPORT = """
Failures:
[1]:
  time      : 2026-12-02_10:06:34
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 17346)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 17346
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_10:06:34
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 17345)
"""


def test_a_rank_killed_under_torchrun_is_a_crash_whichever_rank_torch_blames(tmp_path):
    from gpuforge.launch.script import _crash, _Stop, rank_signals
    from gpuforge.spec import load_spec

    assert rank_signals(TORCHRUN_REPORT) == [9]
    log = tmp_path / "script.log"
    log.write_text("an earlier attempt's report: exitcode  : -11 (pid: 1)\n" + TORCHRUN_REPORT)
    start = len("an earlier attempt's report: exitcode  : -11 (pid: 1)\n")
    spec = load_spec(_job(tmp_path, "python loop.py 3", script={"launcher": "torchrun"}))
    assert _crash(spec, 1, _Stop(), log, start) == "a rank was killed by SIGKILL"
    log.write_text(TORCHRUN_REPORT.replace("-9 (pid", "-15 (pid"))  # stopped by torchrun: not a crash
    assert _crash(spec, 1, _Stop(), log, 0) is None


def test_a_failing_script_fails_with_the_end_of_its_log(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "bad.py").write_text(
        "print('loading data')\nraise SystemExit('no such column: label')\n"
    )
    spec = _job(tmp_path, "python bad.py", files=["bad.py"])
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert result.returncode == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert summary["reason"] == "the script exited 1: loading data | no such column: label"


@pytest.mark.parametrize(
    "command, files, script, message",
    [
        ("no-such-tool --x", [], {}, "script.command: 'no-such-tool' not found"),
        ("python loop.py 3", ["loop.py", "data/"], {}, "script.files: data/ not found in"),
        ("bash run.sh", [], {"launcher": "torchrun"}, "script.launcher: torchrun starts a Python script"),
        (
            "python loop.py 3",
            ["../secrets"],
            {},
            "script.files: '../secrets': a path inside the job's folder",
        ),
        (
            "python loop.py 3",
            [],
            {"env": {"GPUFORGE_RUN_DIR": "/"}},
            "script.env: GPUFORGE_RUN_DIR: gpuforge sets",
        ),
        (  # what caps a fraction of a GPU: a script may not lift its own
            "python loop.py 3",
            [],
            {"env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}},
            "script.env: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: gpuforge sets",
        ),
        (
            "python loop.py 3",
            [],
            {"env": {"CUDA_DEVICE_MEMORY_LIMIT": "80g"}},
            "script.env: CUDA_DEVICE_MEMORY_LIMIT: gpuforge sets",
        ),
    ],
)
def test_bad_script_jobs_are_refused_before_anything_runs(tmp_path, command, files, script, message):
    spec = _job(tmp_path, command, files=files, script=script)
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_a_runner_without_user_code_refuses_a_script(tmp_path):
    spec = _job(tmp_path, "python loop.py 3")
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"), env={"GPUFORGE_USER_CODE": "0"})
    assert (
        result.returncode == 2
        and "kind: script runs your own command: it needs an admin key" in result.stderr
    )


def test_track_imports_no_torch_and_does_nothing_outside_a_run(tmp_path):
    code = (
        "import sys; from gpuforge import track; assert 'torch' not in sys.modules; "
        "track.log(0, loss=1.0); print(track.should_stop(), track.resume_step(), track.run_dir())"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPUFORGE_RUN_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0", "None"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's server tests: each submits and watches its own job."""
    from gpuforge.server.local import LocalServer

    tmp = tmp_path_factory.mktemp("script-server")
    with LocalServer(tmp / "home", log=tmp / "server.log") as server:
        yield server


@pytest.mark.slow
def test_a_server_queues_a_script_job_with_its_files_and_refuses_one_from_a_key_without_user_code(
    tmp_path, monkeypatch, server
):
    import httpx

    spec = _job(tmp_path, "python loop.py 8", files=["loop.py", "data/"])
    (spec.parent / "data").mkdir()
    (spec.parent / "data" / "rows.txt").write_text("1\n2\n")  # read by the script in its working copy
    (spec.parent / "loop.py").write_text(
        LOOP.replace("import sys, time", "import sys, time\nopen('data/rows.txt')")
    )
    monkeypatch.setenv("GPUFORGE_URL", server.url)
    monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
    submitted = run_cli("submit", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"})
    job = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), timeout=90)
    assert job["state"] == "finished", (job, (server.home / "runs" / f"job-{job_id}" / "logs").iterdir())
    metrics = http.get(f"/api/v1/jobs/{job_id}/metrics").json()
    assert [m["step"] for m in metrics] == list(range(8))
    assert http.get(f"/api/v1/jobs/{job_id}/summary").json()["kind"] == "script"
    work = server.home / "runs" / f"job-{job_id}.work"
    assert (work / "data" / "rows.txt").read_text() == "1\n2\n" and (work / "loop.py").is_file()

    alice = json.loads(run_cli("keys", "create", "alice", "--json").stdout)["key"]
    monkeypatch.setenv("GPUFORGE_API_KEY", alice)
    refused = run_cli("submit", str(spec))
    assert (
        refused.returncode == 2
        and "kind: script runs your own command: it needs an admin key" in refused.stderr
    )
    missing = _job(tmp_path / "other", "python loop.py 3", files=["loop.py", "nothing/"])
    monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
    gone = run_cli("submit", str(missing))
    assert gone.returncode == 2 and "script.files: nothing/ not found" in gone.stderr


# a loop that checkpoints every 5 steps on its own, as long runs do
PERIODIC = """
import time
from gpuforge import track

for step in range(track.resume_step(), 40):
    time.sleep(0.1)
    track.log(step, loss=1.0 / (step + 1))
    if step % 5 == 4:
        (track.checkpoint_dir() / "state.txt").write_text(str(step))
        track.checkpointed(step)
"""


@pytest.mark.slow
def test_a_server_restarts_a_script_job_whose_runner_was_killed_from_the_script_checkpoint(tmp_path, server):
    import httpx

    from gpuforge.spec import load_spec
    from tests.helpers.jobs import runner_pid

    spec = _job(tmp_path, "python periodic.py", files=["periodic.py"])
    (spec.parent / "periodic.py").write_text(PERIODIC)
    job_id = server.client().submit(load_spec(spec))["id"]
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"})
    running = wait_for_job(http, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 12)
    run = Path(running["run_dir"])
    os.kill(runner_pid(running["run_dir"]), signal.SIGKILL)  # as the OOM killer would: no last word
    job = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), timeout=120)
    assert job["state"] == "finished" and "restart 1 of" in (job["reason"] or ""), (job, _log_tail(run))
    starts = [e for e in http.get(f"/api/v1/jobs/{job_id}/events").json() if e["kind"] == "started"]
    assert len(starts) == 2 and starts[1]["data"]["how"] == "resumes from its checkpoint"
    assert starts[1]["data"]["resumes_from"] >= 10  # steps 0-9 at least were saved before the kill
    steps = [m["step"] for m in http.get(f"/api/v1/jobs/{job_id}/metrics", params={"limit": 100}).json()]
    assert steps == list(range(40))  # the steps past the checkpoint that the kill lost are logged once
    assert not _processes_of(run)  # the killed attempt's script died with its runner


@pytest.mark.slow
def test_a_relative_out_a_crash_while_saving_and_workers_left_behind(tmp_path):
    crash = """
import multiprocessing, signal, sys, time
from gpuforge import track

def worker():
    time.sleep(600)

if __name__ == "__main__":
    track.log(0, loss=1.0)
    multiprocessing.Process(target=worker).start()  # left running, as a data loader's worker can be
    while not track.should_stop():
        time.sleep(0.05)
    raise SystemExit("disk full while saving")
"""
    spec = _job(tmp_path, "python crash.py", files=["crash.py"], resources={"max_time": "3s"})
    (spec.parent / "crash.py").write_text(crash)
    result = run_cli("train", str(spec), "--out", "relative-run", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    summary = json.loads((tmp_path / "relative-run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["metrics_reported"]  # track found its run directory
    assert summary["reason"] == "the script exited 1: disk full while saving"  # not "paused": it crashed
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _runs(p, str(spec.parent))]


def _runs(proc: Path, folder: str) -> bool:
    """Whether a process runs in `folder` (the script's working copy): its worker would."""
    try:
        return os.readlink(proc / "cwd") == folder
    except OSError:
        return False


@pytest.mark.slow
def test_plan_refuses_a_script_job_and_track_takes_numpy_steps(tmp_path):
    spec = _job(tmp_path, "python loop.py 3")
    refused = run_cli("plan", str(spec))
    assert refused.returncode == 2 and "kind: script: plan is for jobs gpuforge trains" in refused.stderr
    code = (
        "import numpy as np; from gpuforge import track; track.log(np.int64(3), loss=np.float32(0.5)); "
        "track.checkpointed(np.int64(3)); print(track.resume_step())"
    )
    env = {**os.environ, "GPUFORGE_RUN_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 3


def test_a_train_spec_is_stored_without_a_kind_so_older_runs_and_servers_read_it():
    from gpuforge.spec import parse_spec

    raw = {"model": {"source": "bundled:gpt-tiny", "task": "causal-lm"}, "data": {"train": "x"}}
    spec = parse_spec(raw, Path("/"))
    assert spec.kind == "train" and "kind" not in spec.to_yaml()


@pytest.mark.slow
def test_tensorboard_scalars_a_script_writes_become_its_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    writer = """
import os, sys, time, types

# tensorboard's own switch to its TensorFlow stub (its no_tensorflow build): the same event files, without
# importing tensorflow where it is installed (7 s of CPU)
sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter(os.path.join(os.environ["GPUFORGE_RUN_DIR"], "tensorboard"))
for step in range(4):
    writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    writer.add_scalar("lr", 0.1, step)
    writer.flush()
    time.sleep(0.3)
writer.close()
"""
    spec = _job(tmp_path, "python tb.py", files=["tb.py"])
    (spec.parent / "tb.py").write_text(writer)
    run = tmp_path / "run"
    result = run_cli("train", str(spec), "--out", str(run))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m["step"] for m in lines) == [0, 1, 2, 3]  # one line a step, each step once
    by_step = {m["step"]: m for m in lines}
    assert by_step[3]["train/loss"] == pytest.approx(0.25) and by_step[0]["lr"] == pytest.approx(0.1)
    assert {m["source"] for m in lines} == {"tensorboard"}
    assert json.loads((run / "summary.json").read_text())["final_loss"] is None  # no `loss` tag of that name


KERAS_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "keras-digits.yaml"


@pytest.mark.slow
def test_the_keras_example_reports_checkpoints_on_sigterm_and_resumes(tmp_path):
    if os.environ.get("GPUFORGE_REQUIRE_TENSORFLOW") != "1":
        pytest.importorskip(
            "keras", reason="tensorflow-cpu is not installed here (the dev set-up installs it)"
        )
    run, epochs = tmp_path / "run", 40
    longer = ["--set", f"script.command=python keras_digits.py --epochs {epochs}"]
    returncode, out, err = _stopped_after(["train", str(KERAS_EXAMPLE), "--out", str(run), *longer], run, 2)
    assert returncode == 143, out[-2000:] + err
    stopped = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= len(stopped) < epochs and (run / "checkpoints" / "script" / "model.keras").is_file()

    resumed = run_cli("train", str(KERAS_EXAMPLE), "--out", str(run), *longer, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from epoch {stopped[-1]}" in resumed.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(epochs))  # each epoch once, across the two attempts
    assert metrics[-1]["eval_accuracy"] > 0.9 and metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.slow
def test_the_pytorch_example_under_torchrun_stops_on_sigterm_and_resumes_one_process_a_device(tmp_path):
    spec, run, epochs = KERAS_EXAMPLE.parent / "torch-digits.yaml", tmp_path / "ddp", 150
    command = f"script.command=python torch_digits.py --epochs {epochs}"
    args = ["train", str(spec), "--out", str(run), "--set", command]
    args += ["--set", "script.launcher=torchrun", "--set", "resources.devices=2"]
    returncode, out, err = _stopped_after(args, run, 2, timeout=180)
    assert returncode == 143, out[-2000:] + err + _log_tail(run)  # both ranks saved and ended in the grace
    stopped = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= len(stopped) < epochs and (run / "checkpoints" / "script" / "state.pt").is_file()

    # a runner killed outright (no word to anyone) takes torchrun and both ranks with it
    runner = subprocess.Popen([sys.executable, "-m", "gpuforge", *args], stdout=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    # the cheap check first: /proc is read only once the attempt has logged an epoch past the stop
    training = lambda: len(metrics.read_text().splitlines()) > len(stopped) and len(_processes_of(run)) == 4  # noqa: E731
    _wait_for(training, "the runner, torchrun and two ranks at work")
    runner.kill()
    runner.wait()
    _wait_for(lambda: not _processes_of(run), "no process of the run left")

    # the killed attempt may have checkpointed again (every 5 epochs) before it died: the newest one counts
    saved = max(e["step"] for e in _events(run) if e["event"] == "checkpoint")
    assert saved >= stopped[-1]
    resumed = run_cli(*args, timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr + _log_tail(run)
    assert f"resumed from epoch {saved}" in resumed.stdout
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(epochs))  # rank 0's lines only, each epoch once
    assert lines[-1]["eval_accuracy"] > 0.8  # the two trained one model (DistributedDataParallel over gloo)
    command = _events(run)[0]["command"]
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in command
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes"] == 2
    events = _events(run)
    last_start = max(i for i, e in enumerate(events) if e["event"] == "started")
    assert events[last_start]["resumes_from"] == saved + 1  # this run went on from the checkpoint
    restarts = [e for e in events[last_start:] if e["event"] == "restarted"]
    if restarts:
        # gloo's teardown may abort a rank as it exits after the last epoch ("terminate called without an
        # active exception", once in four CI runs): the runner restarts it, and nothing is left to run
        assert [(e["reason"], e["resumes_from"]) for e in restarts] == [
            ("a rank was killed by SIGABRT", epochs)
        ]
    assert summary["resumed_from"] == (epochs if restarts else saved + 1)
