"""Deployments kept alive by the scheduling loop: each replica is a `gpuforge serve` process on loopback,
on a device of its own, restarted when it dies, stopped on undeploy.

A tick (in the loop's transaction) walks the deployments that are starting, ready or stopping:
- stopping: SIGTERM every replica (it finishes what it holds), `stopped` once all are gone;
- otherwise each replica whose process is gone is started again (a free device, a new port) while
  `restarts < max_restarts`, else the deployment fails; a live one is asked /readyz (50 ms at most);
  the deployment is `ready` when all its replicas are.
Workers listen on 127.0.0.1 only and want the deployment's own key: clients reach them through the
server (routes/deployments.py), which forwards each request to the least loaded ready replica.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpuforge.runtime.host import free_port, is_alive
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.serve.options import serve_flags
from gpuforge.store import states
from gpuforge.store.models import LIVE_DEPLOYMENT_STATES as LIVE
from gpuforge.store.models import Deployment, DeploymentState

log = logging.getLogger("gpuforge.scheduler")
ReplicaEnv = Callable[[Session, Deployment, DeviceInfo], dict[str, str]]
STOP_GRACE_S = 30.0


def held_devices(s: Session) -> set[str]:
    """Devices the replicas of live deployments hold."""
    held = set()
    for (workers,) in s.execute(select(Deployment.workers).where(Deployment.state.in_(LIVE))):
        held |= {w["device"] for w in workers or [] if w.get("pid") and w.get("device")}
    return held


def keep(
    s: Session, devices: list[DeviceInfo], held: set[str], logs_dir: Path, replica_env: ReplicaEnv
) -> None:
    """One pass over the live deployments (see the module's docstring). `held`: devices jobs hold;
    `replica_env`: the whole environment of a replica (Scheduler.replica_env: allow-listed, its key).

    The loop alone writes `workers`; the API writes `state` (undeploy: `stopping`). So workers are
    written as they are, and a state only by a move of store/states.py, which leaves from the state this
    pass read alone: an undeploy that lands mid-pass is never overwritten. Each launch is committed at
    once, so a server that dies next still knows the process it started."""
    rows = s.execute(select(Deployment.id, Deployment.state).where(Deployment.state.in_(LIVE))).all()
    for deployment_id, state in rows:
        deployment = s.get(Deployment, deployment_id, populate_existing=True)
        if state in (DeploymentState.STOPPING, DeploymentState.FAILING):
            workers, done = _stop(deployment)
            _write_workers(s, deployment, workers)
            if done and state == DeploymentState.STOPPING:
                states.deployment_stopped(s, deployment.id)
            elif done:
                states.deployment_failed(s, deployment.id)
            continue
        workers = [dict(w) for w in deployment.workers or []]
        while len(workers) < deployment.replicas:
            workers.append({"index": len(workers), "pid": None, "restarts": -1, "ready": False})
        taken = held | held_devices(s)
        failure = None  # why it cannot serve
        for worker in workers:
            if worker.get("pid") and is_alive(worker["pid"], deployment.model_dir):
                ready, error = _ready(worker["port"])
                worker["ready"] = worker["ready"] or ready
                if error:  # it answers, and says its model will not load: no restart will help
                    failure = f"replica {worker['index']}: {error}"
                continue
            previous = worker.get("device")
            if worker.get("pid"):
                _reap(worker["pid"])
                log.info("deployment %s: replica %d ended", deployment.name, worker["index"])
            worker.update(pid=None, ready=False, device=None)
            if worker["restarts"] >= deployment.max_restarts:
                failure = f"replica {worker['index']} ended {worker['restarts'] + 1} times"
                break
            free = [
                d
                for d in devices
                if d.kind == deployment.device_type and (d.id == previous or d.id not in taken)
            ]
            free.sort(
                key=lambda d: d.id != previous
            )  # its own device first: not handed to the queue meanwhile
            if not free:
                continue  # waits for a device, like a queued job
            taken.add(free[0].id)
            env = replica_env(s, deployment, free[0])
            worker.update(_launch(deployment, worker["index"], free[0], logs_dir, env), device=free[0].id)
            worker["restarts"] += 1
            _write_workers(s, deployment, workers)
            s.commit()  # the pid is in the store before anything else can fail
        _write_workers(s, deployment, workers)
        _settle(s, deployment.id, state, failure, all(w["ready"] for w in workers))


def _write_workers(s: Session, d: Deployment, workers: list[dict]) -> None:
    s.execute(update(Deployment).where(Deployment.id == d.id).values(workers=workers))


def _settle(
    s: Session, deployment_id: int, read_state: DeploymentState, failure: str | None, all_ready: bool
) -> None:
    """The state its replicas say: failing when one cannot serve, else ready once all of them are."""
    if failure is not None:
        states.deployment_failing(s, deployment_id, failure)
    elif all_ready and read_state == DeploymentState.STARTING:
        states.deployment_ready(s, deployment_id)
    elif not all_ready and read_state == DeploymentState.READY:
        states.deployment_starting(s, deployment_id)


def _launch(deployment: Deployment, index: int, device: DeviceInfo, logs_dir: Path, env: dict) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "gpuforge", "serve", deployment.model_dir, "--port", str(port),
               "--host", "127.0.0.1", "--device", device.kind]  # fmt: skip
    command += serve_flags(deployment.options)
    log_path = logs_dir / deployment.name / f"replica-{index}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # outlives a server restart, like a job's runner
        )  # fmt: skip
    log.info(
        "deployment %s: replica %d on %s, port %d (pid %d)",
        deployment.name,
        index,
        device.id,
        port,
        process.pid,
    )
    return {"pid": process.pid, "port": port, "ready": False}


def _ready(port: int) -> tuple[bool, str | None]:
    """(ready, why it never will be): a replica that answers 503 with another reason than loading failed."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=0.05)
    except httpx.HTTPError:
        return False, None
    if answer.status_code == 200:
        return True, None
    try:
        detail = str(answer.json().get("detail"))
    except ValueError:
        detail = answer.text[:200]
    return False, (None if "still loading" in detail else detail)


def _stop(deployment: Deployment) -> tuple[list[dict], bool]:
    """SIGTERM each replica still running, once (a second one would cut its graceful stop short), SIGKILL
    one still there after STOP_GRACE_S. (the workers, whether none is left)."""
    workers = [dict(w) for w in deployment.workers or []]
    now = time.time()
    for worker in workers:
        worker["ready"] = False
        if not (worker.get("pid") and is_alive(worker["pid"], deployment.model_dir)):
            _reap(worker.get("pid"))
            worker["pid"] = None
            continue
        signalled = worker.get("signalled_at")
        if signalled is None or now - signalled > STOP_GRACE_S:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker["pid"], signal.SIGTERM if signalled is None else signal.SIGKILL)
            worker["signalled_at"] = signalled or now
    return workers, not any(w.get("pid") for w in workers)


def _reap(pid: int | None) -> None:
    """Collect the exit status of a replica this server started (else it stays a zombie)."""
    if pid:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # started by an earlier server: its parent is gone, init collects it
