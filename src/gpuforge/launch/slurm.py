"""A job as one Slurm job (GPUFORGE_EXECUTOR=slurm): the `gpuforge train` process submits a batch script
with `sbatch`, follows the job with `scontrol`, and stays the job's launcher on this (login) machine.

The batch script starts the ranks with `srun`, one task a device (`--gres=gpu:N`, or CPUs), each a
`python -m gpuforge.train.rank` told its place by Slurm's variables (RANK from SLURM_PROCID, ...) with
torch's rendezvous on the allocation's first node. The run directory must be on a filesystem the nodes
share: the ranks write it where they run, and this process reads the summary rank 0 wrote.

    SIGTERM or SIGINT here    `scancel --signal=TERM`: every rank checkpoints at its next step and exits
    `scontrol requeue`        the job runs again, and its ranks resume from their checkpoint
    a job Slurm ended         its state and exit code (TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...) are the
                              failure's reason; a time limit or out of memory would come again: no restart
    resources.max_time        Slurm's --time, TIME_MARGIN_MIN minutes more

The Slurm job's id is kept in <run>/logs/slurm-job: a launcher started again for the same run (the server
restarts one that died) follows that job while it lives, rather than submitting a second one.
"""

from __future__ import annotations

import logging
import math
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from gpuforge.errors import GpuforgeError
from gpuforge.runs import RunDir
from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.launch")

POLL_S = 1.0
MASTER_PORT = 29431  # torch's rendezvous on the allocation's first node
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}  # fmt: skip
WOULD_REPEAT = {"TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL"}  # a restart would end the same way
JOB_FILE = "slurm-job"
TIME_MARGIN_MIN = 5  # Slurm's time limit past resources.max_time: the checkpoint at max_time comes first


def check_slurm() -> None:
    """An error naming what is missing where Slurm's commands are not on PATH."""
    missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        raise GpuforgeError(
            f"executor slurm: {', '.join(missing)} not found on PATH (run gpuforge on a Slurm login node)"
        )


def batch_script(spec: JobSpec, run: RunDir, argv: list[str], options: dict[str, str | None]) -> str:
    """The batch script for one attempt: resources, output, then the ranks by srun."""
    r = spec.resources
    on_gpu = r.device_type == "cuda"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=gpuforge-{_safe(spec.name)}",
        f"#SBATCH --output={run.logs_dir / 'slurm-%j.log'}",
        f"#SBATCH --ntasks={r.devices}",
        "#SBATCH --requeue",  # a preempted or requeued job runs again: its ranks resume from the checkpoint
    ]
    if on_gpu:
        lines.append("#SBATCH --gpus-per-task=1")
    else:
        lines.append(f"#SBATCH --cpus-per-task={options.get('cpus_per_task') or 1}")
    if r.max_time_s is not None:  # gpuforge pauses the job at max_time; Slurm's limit is for a hung one
        lines.append(f"#SBATCH --time={math.ceil(r.max_time_s / 60) + TIME_MARGIN_MIN}")
    for flag in ("partition", "account", "qos"):
        if options.get(flag):
            lines.append(f"#SBATCH --{flag}={options[flag]}")
    rank = " ".join(shlex.quote(a) for a in argv)
    lines += [
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_ADDR MASTER_PORT={MASTER_PORT} WORLD_SIZE=$SLURM_NTASKS",
        # srun passes a signal on to every task; each rank's variables come from its task's own
        "exec srun --kill-on-bad-exit=1 bash -c "
        + shlex.quote(f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec {rank}"),
    ]
    return "\n".join(lines) + "\n"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:64]


def job_state(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields for `job_id` ({} once Slurm has forgotten it)."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    if shown.returncode != 0:
        return {}
    fields = {}
    for token in shown.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def submit(script: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    if done.returncode != 0:
        raise GpuforgeError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def cancel(job_id: str, signal_name: str = "TERM") -> None:
    """Send every rank (each step's tasks) the signal: they checkpoint and exit."""
    subprocess.run(["scancel", f"--signal={signal_name}", job_id], capture_output=True, timeout=30)


def follow(run: RunDir, job_id: str, stop: threading.Event) -> dict[str, Any]:
    """Wait for the job's end; on `stop`, ask its ranks to stop (once) and wait for them. Its last
    fields, with `stopped`: whether we asked."""
    asked = False
    while True:
        if stop.is_set() and not asked:
            log.info("stopping Slurm job %s: its ranks checkpoint and exit", job_id)
            cancel(job_id)
            asked = True
        fields = job_state(job_id)
        state = fields.get("JobState", "")
        if not fields or state in ENDED and not (state == "PREEMPTED" and fields.get("Requeue") == "1"):
            return {**fields, "stopped": asked}
        time.sleep(POLL_S)


def outcome_of(job_id: str, fields: dict[str, str]) -> tuple[str | None, bool]:
    """(how the job failed in Slurm's words, or None; whether a restart would only repeat it)."""
    state = fields.get("JobState", "")
    if not fields:
        return f"Slurm job {job_id} was forgotten by Slurm before its end was seen", False
    if state == "COMPLETED":
        return None, False
    reason = fields.get("Reason", "None")
    detail = f", reason {reason}" if reason not in ("None", "") else ""
    return f"Slurm job {job_id} ended {state} (exit code {fields.get('ExitCode', '?')}{detail})", (
        state in WOULD_REPEAT
    )


def running_job(run: RunDir) -> str | None:
    """The Slurm job an earlier launcher of this run submitted, while Slurm still runs (or queues) it."""
    path = run.logs_dir / JOB_FILE
    try:
        job_id = path.read_text().strip()
    except OSError:
        return None
    if not job_id.isdigit():
        return None
    state = job_state(job_id).get("JobState", "")
    return job_id if state and state not in ENDED else None
