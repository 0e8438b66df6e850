"""`distributed.strategy: ddp` end to end: `gpuforge train` launches real ranks (torchrun's elastic agent,
gloo), which must train the same model as one process would, count their bytes, resume with another
number of processes, and survive a killed or hung rank by restarting from the last checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuforge.artifact import load_artifact
from gpuforge.runs import RunDir
from tests.helpers.ddp_specs import write_ddp_spec as write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)


def gpuforge(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "gpuforge", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in RunDir(run).metrics()}


def train_once(folder: Path, name: str, **sections) -> Path:
    """`gpuforge train` of `write_spec(folder, name, **sections)` into `folder/name`, which must finish."""
    done = gpuforge("train", str(write_spec(folder, name, **sections)), "--out", str(folder / name))
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / name


# Runs that several tests read and none writes: each a launcher and its ranks, started once per module.
# Taken by a test that writes into a run, a copy (shutil.copytree) is what it writes into.
FLAT = {"warmup_steps": 0, "min_lr_ratio": 1.0}  # a constant rate: max_steps, changed below, is then moot


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory) -> tuple[Path, Path]:
    """The digits' MLP trained 12 steps by one process and by two (ddp), the default schedule."""
    folder = tmp_path_factory.mktemp("one-and-two")
    return train_once(folder, "one", resources={"devices": 1}), train_once(folder, "two")


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The reference of the resume tests: 12 steps in one process at a constant rate."""
    return train_once(tmp_path_factory.mktemp("whole"), "whole", resources={"devices": 1}, train=FLAT)


def test_two_processes_train_what_one_does_and_count_their_bytes(one_and_two):
    one, two = one_and_two
    a, b = losses(one), losses(two)
    assert sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    summary = RunDir(two).summary()
    assert summary["processes"] == 2 and summary["strategy"] == "ddp"
    assert summary["status"] == "finished"
    assert (two / "logs" / "train-rank1.log").exists()  # rank 1 logs apart, writes nothing else
    # plain all-reduce: each step hands the whole gradient (fp32) to the collective
    params = 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert {r["comm_bytes"] for r in RunDir(two).metrics()} == {params * 4}


def test_compression_fp16_halves_the_bytes_powersgd_cuts_more(tmp_path):
    counts = {}
    for kind in ("fp16", "powersgd"):
        spec = write_spec(
            tmp_path,
            kind,
            distributed={"gradient_compression": kind, "powersgd_rank": 2},
            model={"options": {"width": 256}},
        )
        done = gpuforge("train", str(spec), "--out", str(tmp_path / kind))
        assert done.returncode == 0, done.stderr[-3000:]
        last = RunDir(tmp_path / kind).metrics()[-1]
        counts[kind] = (last["comm_bytes"], last["comm_bytes_uncompressed"])
    assert counts["fp16"][0] * 2 == counts["fp16"][1]
    assert counts["powersgd"][0] * 10 < counts["powersgd"][1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_processes_resumes_with_one_and_back(tmp_path, strategy, whole):
    run = tmp_path / "r"
    for devices, steps in ((2, 6), (1, 9), (2, 12)):
        spec = write_spec(
            tmp_path,
            "part",
            resources={"devices": devices},
            train={**FLAT, "max_steps": steps},
            distributed={"strategy": strategy},
        )
        done = gpuforge("train", str(spec), "--out", str(run))
        assert done.returncode == 0, done.stderr[-3000:]

    resumed, reference = losses(run), losses(whole)
    assert sorted(resumed) == list(range(1, 13))
    for step, value in reference.items():
        assert resumed[step] == pytest.approx(value, rel=1e-4), step
    started = [e for e in RunDir(run).events() if e["event"] == "started"]
    assert [(e["processes"], e["resumed_from"], e["strategy"]) for e in started] == [
        (2, None, strategy),
        (1, 6, strategy),
        (2, 9, strategy),
    ]
    held = RunDir(run).summary()["process_state_bytes"]
    alone = RunDir(whole).summary()["process_state_bytes"]
    for part in ("params", "optimizer"):
        # FSDP: each of 2 processes holds half (and a step counter a tensor); DDP: the whole, each
        expected = alone[part] if strategy == "ddp" else alone[part] / 2
        assert held[part] == pytest.approx(expected, rel=0.02), part
    model, _, manifest = load_artifact(run / "model")  # the whole model, whichever strategy wrote it
    assert manifest["step"] == 12
    assert sum(p.numel() for p in model.parameters()) == 64 * 64 * 2 + 64 * 10 + 64 * 2 + 10


def rank_pids(run: Path) -> dict[int, int]:
    """The live ranks of the job writing `run`, by rank, from /proc (their command line and environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"gpuforge.train.rank" not in argv or os.fsencode(str(run)) not in argv:
                continue
            env = dict(
                item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item
            )
            found[int(env[b"RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):
            continue
    return found


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def slow_job(tmp_path: Path, **distributed) -> tuple[Path, Path]:
    spec = write_spec(
        tmp_path,
        "slow",
        train={"max_steps": 60, "checkpoint_every": 10, "batch_size": 64},
        model={"options": {"width": 1024}},  # a few tens of ms a step: time to act mid-run
        distributed=distributed,
    )
    return spec, tmp_path / "run"


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_restarts_the_job_from_its_checkpoint(tmp_path, how):
    spec, run = slow_job(tmp_path, timeout_s=8, max_restarts=2)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "train", str(spec), "--out", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: any(r["step"] >= 15 for r in RunDir(run).metrics()), 120, "step 15")
        victim = rank_pids(run)[1]
        if how == "killed":
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGSTOP)  # alive but silent: only the collective timeout can tell
            # rank 0 gives up after timeout_s; then the agent's SIGTERM is held until the rank runs again
            wait_for(lambda: rank_pids(run).get(0) is None, 60, "rank 0 to fail on the timeout")
            os.kill(victim, signal.SIGCONT)
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-4000:]

    events = RunDir(run).events()
    restarted = [e for e in events if e["event"] == "restarted"]
    assert len(restarted) == 1 and restarted[0]["reason"].startswith(
        "rank 1 was killed by SIGKILL" if how == "killed" else "rank "
    )
    started = [e for e in events if e["event"] == "started"]
    assert [e["restart"] for e in started] == [0, 1]
    assert started[1]["resumed_from"] in (10, 20, 30)
    steps = [r["step"] for r in RunDir(run).metrics()]
    assert steps == list(range(1, 61))  # each step once: the ones past the checkpoint ran again
    assert RunDir(run).summary()["status"] == "finished"
    if how == "hung":
        assert "timed out" in (run / "logs" / "train.log").read_text().lower() or "timeout" in output.lower()


def test_devices_more_than_the_machine_has_is_refused_with_what_exists(tmp_path):
    done = gpuforge(
        "train", str(write_spec(tmp_path, "big", resources={"devices": 16})), "--out", str(tmp_path / "x")
    )
    assert done.returncode == 2
    assert "resources.devices: 16" in done.stderr and "this machine has" in done.stderr
    assert not (tmp_path / "x").exists()


def test_spec_errors_name_the_field(tmp_path):
    done = gpuforge(
        "train",
        str(write_spec(tmp_path, "bad", distributed={"strategy": "none"})),
        "--out",
        str(tmp_path / "x"),
    )
    assert done.returncode == 2 and "needs distributed.strategy ddp or fsdp" in done.stderr
    done = gpuforge(
        "train",
        str(write_spec(tmp_path, "bad2", distributed={"strategy": "fsdp", "gradient_compression": "fp16"})),
        "--out",
        str(tmp_path / "x"),
    )
    assert done.returncode == 2 and "gradient_compression: fp16" in done.stderr


def test_a_killed_launcher_takes_its_ranks_with_it_and_sigterm_stops_them_at_one_step(tmp_path):
    spec, run = slow_job(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    argv = [sys.executable, "-m", "gpuforge", "train", str(spec), "--out", str(run)]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_for(lambda: any(r["step"] >= 5 for r in RunDir(run).metrics()), 120, "step 5")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    summary = RunDir(run).summary()
    assert summary["status"] == "cancelled" and summary["steps"] < 60
    assert RunDir(run).latest_checkpoint()[0] == summary["steps"]  # both ranks stopped at that step

    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_for(lambda: len(rank_pids(run)) == 2, 60, "the ranks of the resumed job")
    # the resumed job under way (its ranks' stop flag set up): waited for, not a fixed sleep
    started = lambda: sum(e["event"] == "started" for e in RunDir(run).events())  # noqa: E731
    wait_for(lambda: started() == 2, 120, "the resumed job to start")
    launcher.kill()  # SIGKILL: no handler runs in the launcher
    launcher.wait()
    wait_for(lambda: not rank_pids(run), 60, "the ranks to stop after their launcher died")
    assert RunDir(run).events()[-1]["event"] == "cancelled"


def test_bad_input_found_by_the_ranks_is_not_retried(tmp_path):
    spec = write_spec(tmp_path, "missing", distributed={"max_restarts": 3})
    spec.write_text(spec.read_text().replace("sklearn:digits", str(tmp_path / "absent.csv")))
    done = gpuforge("train", str(spec), "--out", str(tmp_path / "x"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "refused the job (bad input)" in done.stderr and "absent.csv" in done.stderr
    events = RunDir(tmp_path / "x").events()
    assert [e["event"] for e in events] == ["failed"]  # no restart: it would only fail again


def test_a_run_directory_of_another_job_is_refused_before_anything_is_written(tmp_path, one_and_two):
    shutil.copytree(one_and_two[1], tmp_path / "r")  # a finished run of two processes, another job's
    before = sorted(p.name for p in (tmp_path / "r" / "logs").iterdir())
    events = RunDir(tmp_path / "r").events()
    other = write_spec(tmp_path, "other", train={"lr": 0.5})
    done = gpuforge("train", str(other), "--out", str(tmp_path / "r"))
    assert done.returncode == 2 and "holds a run of a different spec" in done.stderr
    assert RunDir(tmp_path / "r").events() == events
    assert sorted(p.name for p in (tmp_path / "r" / "logs").iterdir()) == before
