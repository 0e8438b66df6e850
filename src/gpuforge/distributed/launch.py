"""Run one job as several processes on this machine, through torchrun's elastic launcher.

    gpuforge train spec.yaml --out runs/x        # with distributed.strategy ddp|fsdp, resources.devices N

The `gpuforge train` process becomes the launcher: it starts N ranks (`python -m gpuforge.train.rank`),
one a device, and waits. A rank that dies (killed, a collective that timed out, a lost peer) makes the
elastic agent stop the others; the launcher then writes a `restarted` event and starts them all again,
and they resume from the newest checkpoint, up to `distributed.max_restarts` times. We count restarts
ourselves (the agent's own max_restarts is 0) because an end the job chose (paused by its budget, a NaN
loss, cancelled) also exits non-zero and must not be retried: rank 0's summary, written in this attempt,
tells them apart from a crash. A SIGTERM to the launcher reaches every rank (the agent forwards it); they
checkpoint at the same step and exit.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gpuforge.errors import GpuforgeError, TrainingFailed
from gpuforge.runs import RunDir
from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.launch")

SHUTDOWN_GRACE_S = 30  # a rank told to stop has this long to checkpoint before SIGKILL


def check_devices(spec: JobSpec) -> str:
    """The device type the ranks will use; an error naming what exists when there are too few."""
    import torch

    wanted, kind = spec.resources.devices, spec.resources.device_type
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "cuda" or (kind == "auto" and gpus):
        if wanted > gpus:
            raise GpuforgeError(f"resources.devices: {wanted} GPUs asked for; this machine has {gpus}")
        return "cuda"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if wanted > cores:
        raise GpuforgeError(
            f"resources.devices: {wanted} CPU processes asked for; this machine has {cores} cores "
            "(a process a core at least)"
        )
    return "cpu"


def launch_local(spec: JobSpec, out: str | Path) -> dict[str, Any]:
    """Train `spec` with `resources.devices` processes into `out`; returns rank 0's summary, with the
    signal that stopped the launcher (if any) under `signal`, as `train()` does."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    device_type = check_devices(spec)
    run = RunDir(out)
    run.check_usable()
    nproc = spec.resources.devices
    if device_type == "cpu":  # the cores this job holds, shared out: N processes must not each take all
        held = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
        os.environ["OMP_NUM_THREADS"] = str(max(1, held // nproc))
    scratch = Path(tempfile.mkdtemp(prefix="gpuforge-launch-"))
    spec_file = scratch / "spec.yaml"
    spec_file.write_text(spec.to_yaml())  # paths in it are absolute already
    restarts = spec.distributed.max_restarts
    try:
        for attempt in range(restarts + 1):
            os.environ["GPUFORGE_RESTART"] = str(attempt)
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                run_id=uuid.uuid4().hex,
                rdzv_backend="c10d",
                rdzv_endpoint="127.0.0.1:0",  # a free port, as torchrun --standalone
                max_restarts=0,  # ours, below: a chosen end must not be retried
                monitor_interval=0.2,
                shutdown_timeout=SHUTDOWN_GRACE_S,
            )
            attempt_start = time.time()
            try:
                elastic_launch(config, entrypoint=sys.executable)(
                    "-m", "gpuforge.train.rank", str(spec_file), "--out", str(Path(out).resolve())
                )
                failure = None
            except ChildFailedError as err:
                failure = _describe_failure(err)
            except SignalException as err:
                summary = run.summary()
                if summary is None or run.summary_path.stat().st_mtime < attempt_start:
                    raise TrainingFailed(
                        f"stopped by {err.sigval.name} before the ranks wrote a summary"
                    ) from None
                return {**summary, "signal": int(err.sigval)}
            summary = run.summary()
            chosen = summary is not None and run.summary_path.stat().st_mtime >= attempt_start
            if failure is None or chosen:
                if summary is None:
                    raise TrainingFailed(f"the ranks ended without a summary in {run.root}")
                if summary.get("status") == "failed":
                    raise TrainingFailed(f"{summary.get('reason')} (run directory {run.root})")
                return {**summary, "signal": None}
            if attempt < restarts:
                log.warning("%s; restart %d of %d from the last checkpoint", failure, attempt + 1, restarts)
                run.event("restarted", attempt=attempt + 1, max_restarts=restarts, reason=failure)
                continue
            reason = f"{failure}; all {restarts} restarts used"
            run.event("failed", reason=reason)
            raise TrainingFailed(f"{reason} (run directory {run.root})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    raise AssertionError("unreachable")


def _describe_failure(err) -> str:
    rank, failure = err.get_first_failure()
    code = failure.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    message = failure.message if isinstance(failure.message, str) and failure.message else ""
    detail = f": {message.splitlines()[0][:200]}" if message and "<N/A>" not in message else ""
    return f"rank {rank} {how}{detail}"
