"""What `gpuforge server --executor slurm` needs of Slurm before and while it hands out devices: the
partition's nodes (their CPUs and the GPUs of their gres, from `sinfo`), and a probe job that shows the
nodes see the server's run directory (the ranks write their run where they run; the server reads it).

Slurm places the ranks itself: the devices the server counts are an upper bound for admission and fair
share, as with Ray, not an assignment of particular GPUs. They are the partition's nodes whatever their
state: a job for a node drained or down a while waits in Slurm's queue (its reason in the job's log),
rather than being refused by a server that counted the partition smaller for that while.
"""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import time
from pathlib import Path

from gpuforge.child_env import child_environment
from gpuforge.errors import GpuforgeError
from gpuforge.launch.slurm import ENDED, job_state, slurm_output, submit

PROBE_S = 120.0  # the probe job runs within this, or the server does not start
_GPUS = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")  # gpu:4, gpu:a100:4, gpu:a100:4(S:0-1)


def default_partition() -> str | None:
    """The partition sbatch submits to when none is named (sinfo marks it with a *)."""
    shown = slurm_output(["sinfo", "-h", "-o", "%P"])
    for line in (shown or "").split():
        if line.endswith("*"):
            return line[:-1]
    return None


def partition_name(partition: str | None) -> str:
    """The partition jobs go to: the one named, or Slurm's default."""
    name = partition or default_partition()
    if name is None:
        raise GpuforgeError("executor slurm: sinfo did not answer, or Slurm has no default partition")
    return name


def partition_nodes(partition: str | None) -> list[dict]:
    """The partition's nodes: [{"cpus", "gpus", "labels", "where"}], one a node. An error naming the
    partition where Slurm does not answer or does not know it."""
    name = partition_name(partition)
    shown = slurm_output(["sinfo", "-h", "-N", "-p", name, "-o", "%N|%c|%G"])
    if shown is None:
        raise GpuforgeError(f"executor slurm: sinfo did not answer for partition {name} (is slurmctld up?)")
    if not shown.strip():
        known = (slurm_output(["sinfo", "-h", "-o", "%P"]) or "").split()
        listed = ", ".join(p.rstrip("*") for p in known) or "none"
        raise GpuforgeError(f"executor slurm: Slurm has no partition {name} (partitions: {listed})")
    nodes: dict[str, dict] = {}
    for line in shown.splitlines():
        node, cpus, gres = (line.split("|") + ["", "", ""])[:3]
        if node and node not in nodes and cpus.isdigit():
            gpus = gres_gpus(gres)
            nodes[node] = {"cpus": int(cpus), "gpus": gpus, "labels": {}, "where": f"Slurm node {node}"}
    if not nodes:
        raise GpuforgeError(f"executor slurm: sinfo shows no node in partition {name}")
    return list(nodes.values())


def gres_gpus(gres: str) -> int:
    """The GPUs of a node's gres as sinfo prints it ("(null)", "gpu:4", "gpu:a100:4(S:0-1),mps:100")."""
    return sum(int(n) for n in _GPUS.findall(gres))


def probe_shared(folder: Path, options: dict[str, str | None], timeout_s: float = PROBE_S) -> str:
    """Run a tiny Slurm job that writes a token into `folder` (made if missing), and read it back here:
    the node it ran on, or an error in one line saying why the run directories would not be shared."""
    probe = folder / f".slurm-probe-{secrets.token_hex(6)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.mkdir(mode=0o700)
    except OSError as err:
        raise GpuforgeError(f"executor slurm: {probe} cannot be made: {err.strerror}") from None
    token, seen, queued = secrets.token_hex(16), probe / "seen", None
    try:
        lines = ["#!/bin/bash", "#SBATCH --job-name=gpuforge-probe", "#SBATCH --ntasks=1", "#SBATCH --time=2",
                 f"#SBATCH --output={shlex.quote(str(probe / 'probe-%j.log'))}"]  # fmt: skip
        chosen = [flag for flag in ("partition", "account", "qos") if options.get(flag)]
        lines += [f"#SBATCH --{flag}={options[flag]}" for flag in chosen]
        lines.append(f'echo {token} "$(hostname)" > {shlex.quote(str(seen))}')
        script = probe / "probe.sh"
        script.write_text("\n".join(lines) + "\n")
        # the allow-listed environment, as a runner's: the server's secrets do not go into Slurm's state
        job_id = queued = submit(script, child_environment())
        fields = _wait_for(job_id, timeout_s)
        queued = None  # it ended
        node = fields.get("NodeList") or fields.get("BatchHost") or "a node"
        written = seen.read_text().split() if seen.is_file() else []
        if written[:1] == [token]:
            return written[1] if len(written) > 1 else node
        state = fields.get("JobState", "UNKNOWN")
        raise GpuforgeError(
            f"executor slurm: probe job {job_id} ran on {node} ({state}) but its file is not in {folder}: "
            "the run directory must be on a filesystem the Slurm nodes share (GPUFORGE_HOME)"
        )
    except OSError as err:
        raise GpuforgeError(f"executor slurm: the probe job's files in {probe}: {err.strerror}") from None
    finally:
        if queued is not None:  # interrupted, or failed while it waited: not left in the queue
            slurm_output(["scancel", queued])
        shutil.rmtree(probe, ignore_errors=True)


def _wait_for(job_id: str, timeout_s: float) -> dict[str, str]:
    """The probe job's last fields once it ended; it is cancelled, with an error saying why it waited,
    where it has not ended within `timeout_s`."""
    deadline, fields = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        fields = job_state(job_id) or fields
        if fields.get("JobState") in ENDED:
            return fields
        time.sleep(0.5)
    slurm_output(["scancel", job_id])
    state, reason = fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None")
    raise GpuforgeError(
        f"executor slurm: probe job {job_id} did not run within {timeout_s:.0f} s ({state}, reason "
        f"{reason}); the server checks that the nodes see its run directory before it starts"
    )
