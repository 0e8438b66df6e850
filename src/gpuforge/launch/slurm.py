"""A job as one Slurm job (GPUFORGE_EXECUTOR=slurm): the `gpuforge train` process submits a batch script
with `sbatch`, follows the job with `scontrol`, and stays the job's launcher on this (login) machine.

The batch script starts the ranks with `srun`, one task a device (`--gpus-per-task=1`, or CPUs), each a
`python -m gpuforge.train.rank` told its place by Slurm's variables (RANK from SLURM_PROCID, ...) with
torch's rendezvous on the allocation's first node. The run directory must be on a filesystem the nodes
share: the ranks write it where they run, and this process reads the summary rank 0 wrote.

    SIGTERM or SIGINT here    a running job's ranks get SIGTERM (`scancel --signal=TERM`): they checkpoint
                              at their next step and exit; a job not started yet is cancelled outright;
                              one that has not ended after STOP_GRACE_S is cancelled outright too
    `scontrol requeue`        Slurm's SIGTERM makes the ranks checkpoint; the job runs again and resumes
    a job Slurm ended         its state and exit code (TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...) are the
                              failure's reason, even where the ranks checkpointed on Slurm's SIGTERM; a
                              time limit, out of memory (Slurm's or a rank's, exit 4) or bad input
                              (exit 2) would come again, and a scancel was meant: no restart
    resources.max_time        Slurm's --time, TIME_MARGIN_MIN minutes more

The Slurm job's id and the launch attempt's id are kept in <run>/logs/slurm-job: a launcher started again
for the same run (the server restarts one that died) follows that job while Slurm knows it, rather than
submitting a second one, and knows the summary its ranks write as that attempt's.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuforge.errors import GpuforgeError
from gpuforge.runs import SLURM_SCRIPT_PREFIX, RunDir, SlurmRuns, first_and_latest
from gpuforge.settings import env_name
from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.launch")

POLL_S = 1.0
STOP_GRACE_S = 60.0  # a stopped job's ranks checkpoint within this, or the job is cancelled outright
UNANSWERED_S = 300.0  # Slurm's controller unreachable this long: the launcher gives up on the job
PREEMPTED_S = 60.0  # a PREEMPTED job not queued again within this was cancelled by its preemption
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}  # fmt: skip
WOULD_REPEAT = {"TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL"}  # a restart would end the same way
RANK_EXITS = {2: "a rank refused the job (bad input)", 4: "a rank ran out of memory"}  # rank.py's codes
HOLDING = {"RUNNING", "COMPLETING"}  # the job holds its nodes (COMPLETING: its epilog): the time is charged
JOB_FILE = "slurm-job"
TIME_MARGIN_MIN = 5  # Slurm's time limit past resources.max_time: the checkpoint at max_time comes first
_OPTION = re.compile(r"[A-Za-z0-9_.,:=+-]+")  # a partition, account or QOS name: one word, no quotes


def check_slurm(options: dict[str, str | None]) -> None:
    """An error naming what is missing where Slurm's commands are not on PATH, or what is wrong with a
    partition, account or QOS name."""
    missing = [c for c in ("sbatch", "scontrol", "scancel", "sinfo", "squeue") if shutil.which(c) is None]
    if missing:
        raise GpuforgeError(
            f"executor slurm: {', '.join(missing)} not found on PATH (run gpuforge on a Slurm login node)"
        )
    for name in ("partition", "account", "qos"):
        value = options.get(name)
        if value and not _OPTION.fullmatch(value):
            raise GpuforgeError(f"{env_name('slurm_' + name)}: {value!r} is not a Slurm {name} name")


def on_gpus(spec: JobSpec, partition: str | None) -> bool:
    """Whether the ranks take a GPU each: device_type cuda, or auto on a partition with GPUs in its gres."""
    kind = spec.resources.device_type
    if kind != "auto":
        return kind == "cuda"
    args = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    shown = slurm_output(args)
    return shown is not None and "gpu" in shown


def batch_script(
    spec: JobSpec, run: RunDir, argv: list[str], options: dict[str, str | None], gpus: bool
) -> str:
    """The batch script for one attempt: resources, output, then the ranks by srun."""
    r = spec.resources
    output = str(run.logs_dir).replace("%", "%%") + "/slurm-%j.log"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=gpuforge-{_safe(spec.name)}",
        f"#SBATCH --output={shlex.quote(output)}",
        f"#SBATCH --ntasks={r.devices}",
        "#SBATCH --requeue",  # a preempted or requeued job runs again: its ranks resume from the checkpoint
    ]
    cpus = int(options.get("cpus_per_task") or 1)
    lines.append("#SBATCH --gpus-per-task=1" if gpus else f"#SBATCH --cpus-per-task={cpus}")
    if r.max_time_s is not None:  # gpuforge pauses the job at max_time; Slurm's limit is for a hung one
        lines.append(f"#SBATCH --time={math.ceil(r.max_time_s / 60) + TIME_MARGIN_MIN}")
    for flag in ("partition", "account", "qos"):
        if options.get(flag):
            lines.append(f"#SBATCH --{flag}={options[flag]}")
    rank = " ".join(shlex.quote(a) for a in argv)
    lines += [
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # a port of this job's own: two jobs whose first node is the same machine must not meet
        "export MASTER_ADDR MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) WORLD_SIZE=$SLURM_NTASKS",
        # srun (22.05 on) does not take the job's CPUs a task by itself; the threads a rank uses follow them
        "CPUS=${SLURM_CPUS_PER_TASK:-1}",
        "export OMP_NUM_THREADS=$CPUS MKL_NUM_THREADS=$CPUS",
        # srun passes a signal on to every task; each rank's variables come from its task's own
        'exec srun --kill-on-bad-exit=1 --cpus-per-task="$CPUS" bash -c '
        + shlex.quote(f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec {rank}"),
    ]
    return "\n".join(lines) + "\n"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:64]


def slurm_output(args: list[str], env: dict[str, str] | None = None) -> str | None:
    """A Slurm command's output; None where it failed or did not answer in time. Run in a session of its
    own: a Ctrl-C meant for the launcher must not kill the command that passes the stop on."""
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, env=env, timeout=60, start_new_session=True
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    return done.stdout if done.returncode == 0 else None


def holding_logs_folders() -> set[str] | None:
    """The logs folders of this user's Slurm jobs that hold their nodes now (HOLDING), read from the batch
    script each was submitted with (squeue's Command, which Slurm lets nobody change; a job's owner may
    change its output path while it waits, requeued); None where squeue did not answer."""
    states = ",".join(sorted(HOLDING))
    shown = slurm_output(["squeue", f"--user={os.getuid()}", "-h", "-t", states, "-O", "Command:0"])
    if shown is None:
        return None
    scripts = (line.strip() for line in shown.splitlines())
    return {os.path.dirname(p) for p in scripts if os.path.basename(p).startswith(SLURM_SCRIPT_PREFIX)}


def job_state(job_id: str) -> dict[str, str] | None:
    """`scontrol show job`'s fields for `job_id`: {} once Slurm has forgotten it, None when Slurm did not
    answer (try again)."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True, text=True, timeout=60, start_new_session=True,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return None
    if shown.returncode != 0:
        return {} if "Invalid job id" in shown.stderr else None
    fields: dict[str, str] = {}
    for token in shown.stdout.split():  # the fields read come before any free text (Slurm's "_" for spaces)
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def submit(script: Path, env: dict[str, str]) -> str:
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True, text=True, env=env, timeout=120, start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise GpuforgeError("sbatch did not answer within 120 s (is slurmctld up?)") from None
    except OSError as err:
        raise GpuforgeError(f"sbatch could not be run: {err.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise GpuforgeError(f"sbatch refused the job: {'; '.join(line.strip() for line in said[-3:])}")
    return done.stdout.strip().split(";")[0]


def follow(
    job_id: str, stop: threading.Event, on_running: Callable[[bool], None] = lambda running: None
) -> dict[str, str]:
    """Wait for the job's end: its last fields ({} where Slurm forgot it meanwhile); `on_running(True)`
    when it is seen holding its nodes (HOLDING), `on_running(False)` when it leaves them for Slurm's queue
    again (requeued) or is suspended, once each change. On `stop`, its ranks are told to stop: SIGTERM to a
    running job's steps, an outright cancel of one not running yet, or of one whose ranks have not ended
    STOP_GRACE_S after their SIGTERM."""
    seen_running = False
    stopping_since: float | None = None
    unanswered_since: float | None = None
    preempted_since: float | None = None
    reason = None
    while True:
        fields = job_state(job_id)
        if fields is None:  # the controller did not answer: not an end, but not for ever either
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > UNANSWERED_S:
                return {"JobState": "UNKNOWN", "Reason": f"Slurm unanswered for {UNANSWERED_S:.0f} s"}
            time.sleep(POLL_S)
            continue
        unanswered_since = None
        state = fields.get("JobState", "")
        # --requeue is always asked, but a partition's PreemptMode may cancel rather than requeue: a job
        # still PREEMPTED a while later is not coming back
        if state == "PREEMPTED" and fields.get("Requeue") == "1":
            preempted_since = preempted_since or time.monotonic()
            requeued = time.monotonic() - preempted_since < PREEMPTED_S
        else:
            preempted_since, requeued = None, False
        if not fields or (state in ENDED and not requeued):
            return fields
        if (state in HOLDING) != seen_running:
            seen_running = state in HOLDING
            on_running(seen_running)
        if fields.get("Reason") != reason:  # why it waits, or why it was held: in the log, once each
            reason = fields.get("Reason")
            if state != "RUNNING" and reason not in (None, "None"):
                log.info("Slurm job %s is %s: %s", job_id, state, reason)
        if stop.is_set():
            now = time.monotonic()
            if state != "RUNNING":
                slurm_output(["scancel", job_id])  # nothing runs to checkpoint: cancelled where it waits
            elif stopping_since is None:
                log.info("stopping Slurm job %s: its ranks checkpoint and exit", job_id)
                slurm_output(["scancel", "--signal=TERM", job_id])
                stopping_since = now
            elif now - stopping_since > STOP_GRACE_S:
                log.warning("Slurm job %s did not stop %.0f s after SIGTERM: cancelled", job_id, STOP_GRACE_S)
                slurm_output(["scancel", job_id])
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
    code = fields.get("ExitCode", "?")
    rank_exit = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
    if rank_exit in RANK_EXITS:
        return f"{RANK_EXITS[rank_exit]} (Slurm job {job_id} ended {state})", True
    # CANCELLED here is someone's scancel (the launcher's own stop never gets this far): not for a restart
    final = state in WOULD_REPEAT or state == "CANCELLED"
    return f"Slurm job {job_id} ended {state} (exit code {code}{detail})", final


def record(run: RunDir, job_id: str, attempt_id: str) -> None:
    (run.logs_dir / JOB_FILE).write_text(f"{job_id} {attempt_id}\n")


def forget(run: RunDir) -> None:
    """The recorded job's end was seen: only a launcher killed before it should follow that job again."""
    (run.logs_dir / JOB_FILE).unlink(missing_ok=True)


class RunningMarks:
    """When this launcher's Slurm jobs run, for the server's ledger and max_time (runs.SlurmRuns): this
    process's pid, and each run's start and end on this machine's clock; a run ends when its job no longer
    holds its nodes (HOLDING): requeued into Slurm's queue, suspended, or ended."""

    def __init__(self, run: RunDir):
        self.run, self.runs = run, []  # [start, end or None]

    def __call__(self, running: bool) -> None:
        now, open_run = time.time(), bool(self.runs) and self.runs[-1][1] is None
        if running == open_run:
            return  # no change: nothing to write (and a job that never ran leaves no file)
        if running:
            self.runs.append([now, None])
        else:
            self.runs[-1][1] = now
        self.runs = first_and_latest(self.runs)
        partial = self.run.slurm_running_path.with_name("slurm-running.partial")
        partial.write_text(SlurmRuns(os.getpid(), tuple((start, end) for start, end in self.runs)).text())
        partial.replace(self.run.slurm_running_path)  # written whole, then moved in: never read half


def job_environment(env: dict[str, str]) -> dict[str, str]:
    """What sbatch passes on to the job: the launcher's environment, less the GPUs it was given on this
    (login) machine, which are not the node's (Slurm sets CUDA_VISIBLE_DEVICES there from the gres)."""
    return {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                        "ROCR_VISIBLE_DEVICES")}  # fmt: skip


def earlier_job(run: RunDir) -> tuple[str, str, dict[str, str]] | None:
    """The Slurm job an earlier launcher of this run submitted, with its launch attempt's id and its fields,
    while Slurm knows it (running, queued, or ended lately); None where there is none to follow."""
    try:
        job_id, attempt_id = (run.logs_dir / JOB_FILE).read_text().split()
    except (OSError, ValueError):
        return None
    if not job_id.isdigit():
        return None
    fields = job_state(job_id)
    return (job_id, attempt_id, fields) if fields else None
