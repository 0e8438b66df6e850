"""The tests' one-node Slurm cluster (scripts/slurm.sh): started where it is not up, its slurm.conf named."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def slurm_conf() -> str:
    """The cluster's slurm.conf, the cluster started first where sinfo does not answer. Skips the test with
    the reason where it cannot start, unless GPUFORGE_REQUIRE_SLURM=1 (CI) says it must."""
    conf = os.environ.get("SLURM_CONF", "")
    answers = (
        conf
        and subprocess.run(
            ["sinfo"], capture_output=True, timeout=30, env={**os.environ, "SLURM_CONF": conf}
        ).returncode
        == 0
    )
    if answers:
        return conf
    started = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm.sh")], capture_output=True, text=True, timeout=600
    )
    if started.returncode != 0:
        reason = "no Slurm cluster could be started here: " + " ".join(started.stderr.splitlines()[-2:])
        if os.environ.get("GPUFORGE_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason}, and GPUFORGE_REQUIRE_SLURM=1 requires one", pytrace=False)
        pytest.skip(reason)
    return started.stdout.strip()


def slurm(*args: str, conf: str) -> str:
    """A Slurm command's output (the tests act as the cluster's admin: scontrol requeue, update)."""
    env = {**os.environ, "SLURM_CONF": conf}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=30).stdout
