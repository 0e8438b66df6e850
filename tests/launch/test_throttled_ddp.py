"""A 2-process DDP job across a throttled link: PowerSGD sends 20x fewer bytes, and it shows in the step time.

Rank 0 and rank 1 run `python -m gpuforge.train.rank` in the two namespaces of a ThrottledLink (200 Mbit/s
each way), so every byte of their all-reduces crosses the shaped veth pair, as between two machines. The
model is an MLP on the digits, wide (1024) so that its 4.5 MB of fp32 gradients take ~0.18 s a step on the
link while the compute takes a few tens of ms: communication dominates, and PowerSGD must win clearly.

Skipped, with the reason, where the link cannot be made (not root, no iproute2, no namespaces). Every rank
runs under a deadline and is killed (its process group) when the job fails or hangs: nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuforge.launch.throttle import ThrottledLink, can_throttle
from gpuforge.profile_files import read_profile
from gpuforge.runs import RunDir

pytestmark = pytest.mark.slow

RATE_MBIT = 200
MASTER_PORT = 29512  # the link's namespaces are private: nothing else can hold it there
STEPS = 16
TIMED_FROM = 4  # steps before are warm-up: first-call allocations, gloo's first connections
JOB_TIMEOUT_S = 90
PROFILED = (6, 3)  # train.profile's window: steps 6 to 8

MODEL = """
from torch import nn

def build(num_labels: int, width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, num_labels))
"""
WIDTH = 1024
PARAMS = 64 * WIDTH + WIDTH + WIDTH * WIDTH + WIDTH + WIDTH * 10 + 10


@pytest.fixture(autouse=True)
def _needs_throttle():
    reason = can_throttle()
    if reason is not None:
        pytest.skip(f"cannot make a throttled link here: {reason}")


def write_spec(tmp_path: Path, kind: str) -> Path:
    (tmp_path / "mlp.py").write_text(MODEL)
    spec = {
        "name": f"link-{kind}",
        "model": {
            "source": "python:mlp.py:build",
            "task": "image-classification",
            "options": {"width": WIDTH},
        },
        "data": {"train": "sklearn:digits", "eval_fraction": 0.1},
        "train": {
            "max_steps": STEPS,
            "batch_size": 64,
            "lr": 1e-3,
            "precision": "fp32",
            "log_every": 1,
            "profile": {"start_step": PROFILED[0], "steps": PROFILED[1]},  # where the step's time goes
        },  # fmt: skip
        "resources": {"devices": 2},
        "distributed": {
            "strategy": "ddp",
            "gradient_compression": kind,
            "powersgd_rank": 4,
            "timeout_s": 30,  # a lost peer fails the job well inside the test's deadline
        },
    }
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the rank's process group (it was started in a session of its own) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def train_across(link: ThrottledLink, spec: Path, out: Path) -> None:
    """Rank r of 2 in namespace r; both must exit 0 within JOB_TIMEOUT_S."""
    procs, logs = [], []
    try:
        for rank in (0, 1):
            argv = [sys.executable, "-m", "gpuforge.train.rank", str(spec), "--out", str(out)]
            logs.append(out.parent / f"{out.name}-rank{rank}.log")
            procs.append(link.start_rank(rank, argv, MASTER_PORT, logs[-1]))
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for proc in procs:
            kill(proc)  # a no-op for a rank that exited (its group is gone)
    if codes != [0, 0]:
        tails = "\n".join(
            f"--- rank {r} ---\n{path.read_text(errors='replace')[-3000:]}" for r, path in enumerate(logs)
        )
        what = "hung" if None in codes else f"exited with {codes}"
        pytest.fail(f"{spec.name}: the ranks {what} (deadline {JOB_TIMEOUT_S}s)\n{tails}")


def test_powersgd_sends_20x_fewer_bytes_and_steps_faster_across_a_slow_link(tmp_path):
    runs = {}
    with ThrottledLink(RATE_MBIT) as link:
        for kind in ("none", "powersgd"):
            train_across(link, write_spec(tmp_path, kind), tmp_path / kind)
            runs[kind] = RunDir(tmp_path / kind)
    names = link.namespaces
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names)

    figures = {}
    for kind, run in runs.items():
        metrics = run.metrics()
        assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
        assert run.summary()["status"] == "finished" and run.summary()["processes"] == 2
        timed = [r for r in metrics if r["step"] >= TIMED_FROM]
        figures[kind] = {
            "bytes": statistics.median(r["comm_bytes"] for r in timed),
            "step_s": statistics.median(r["step_time_s"] for r in timed),
        }
    none, psgd = figures["none"], figures["powersgd"]
    print(f"across {RATE_MBIT} Mbit/s: {figures}")
    assert none["bytes"] == PARAMS * 4  # the whole fp32 gradient, every step
    assert psgd["bytes"] * 20 <= none["bytes"]
    # a 2-rank all-reduce sends about its payload each way: none's step cannot beat the link's time for it,
    # or the bytes went around the link
    link_s = none["bytes"] * 8 / (RATE_MBIT * 1e6)
    assert none["step_s"] >= 0.8 * link_s, (none, link_s)
    assert psgd["step_s"] < none["step_s"]

    # the profile of the uncompressed run: the gradient all-reduce takes most of the step, at about the
    # link's rate, and the advice is the lever the other run pulled; that run is advised nothing of it
    profiles = {kind: read_profile(run.root) for kind, run in runs.items()}
    comm = profiles["none"]["all_reduce"]
    print(f"profile across {RATE_MBIT} Mbit/s: all-reduce {comm}, advice {profiles['none']['advice']}")
    assert comm["share"] >= 0.4 and comm["bytes"] == PARAMS * 4
    assert 0.3 * RATE_MBIT <= comm["bandwidth_bytes_per_s"] * 8 / 1e6 <= 1.2 * RATE_MBIT, comm
    assert any("gradient_compression: powersgd" in line for line in profiles["none"]["advice"])
    assert not any("powersgd" in line for line in profiles["powersgd"]["advice"])
    assert profiles["powersgd"]["all_reduce"]["bytes"] * 20 <= comm["bytes"]
    assert profiles["none"]["slowest_rank"]["ranks"] == 2
