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

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.scheduler.allocator import DeviceInfo, job_environment
from gpuforge.scheduler.executor import is_alive
from gpuforge.server.local import free_port
from gpuforge.store.models import Deployment, utcnow

log = logging.getLogger("gpuforge.scheduler")
LIVE = ("starting", "ready", "stopping")
OPTION_FLAGS = {
    "max_batch": "--max-batch",
    "max_wait_ms": "--max-wait-ms",
    "max_queue": "--max-queue",
    "timeout_s": "--timeout-s",
    "quantize": "--quantize",
    "precision": "--precision",
    "max_length": "--max-length",
}


def held_devices(s: Session) -> set[str]:
    """Devices the replicas of live deployments hold."""
    held = set()
    for (workers,) in s.execute(select(Deployment.workers).where(Deployment.state.in_(LIVE))):
        held |= {w["device"] for w in workers or [] if w.get("pid") and w.get("device")}
    return held


def keep(s: Session, devices: list[DeviceInfo], held: set[str], logs_dir: Path) -> None:
    """One pass over the live deployments (see the module's docstring). `held`: devices jobs hold."""
    for deployment in s.scalars(select(Deployment).where(Deployment.state.in_(LIVE))):
        if deployment.state == "stopping":
            _stop(deployment)
            continue
        workers = [dict(w) for w in deployment.workers or []]
        while len(workers) < deployment.replicas:
            workers.append({"index": len(workers), "pid": None, "restarts": -1, "ready": False})
        taken = held | held_devices(s)
        for worker in workers:
            if worker.get("pid") and is_alive(worker["pid"], deployment.model_dir):
                worker["ready"] = worker["ready"] or _ready(worker["port"])
                continue
            if worker.get("pid"):
                _reap(worker["pid"])
                log.info("deployment %s: replica %d ended", deployment.name, worker["index"])
            worker.update(pid=None, ready=False, device=None)
            if worker["restarts"] >= deployment.max_restarts:
                deployment.state = "failed"
                deployment.reason = f"replica {worker['index']} ended {worker['restarts'] + 1} times"
                break
            device = next(
                (d for d in devices if d.kind == deployment.device_type and d.id not in taken), None
            )
            if device is None:
                continue  # waits for a device, like a queued job
            taken.add(device.id)
            worker.update(_launch(deployment, worker["index"], device, logs_dir), device=device.id)
            worker["restarts"] += 1
        deployment.workers = workers  # a new list: the JSON column sees the change
        if deployment.state != "failed":
            deployment.state = "ready" if all(w["ready"] for w in workers) else "starting"
        if deployment.state == "failed":
            _stop(deployment, final="failed")


def _launch(deployment: Deployment, index: int, device: DeviceInfo, logs_dir: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "gpuforge", "serve", deployment.model_dir, "--port", str(port),
               "--host", "127.0.0.1", "--device", device.kind]  # fmt: skip
    for key, flag in OPTION_FLAGS.items():
        if deployment.options.get(key) is not None:
            command += [flag, str(deployment.options[key])]
    log_path = logs_dir / deployment.name / f"replica-{index}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **job_environment([device]), "GPUFORGE_API_KEY": deployment.worker_key}
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


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=0.05).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(deployment: Deployment, final: str = "stopped") -> None:
    """SIGTERM each replica still running, once (a second one would cut its graceful stop short); the
    deployment is `final` once none is left."""
    workers = [dict(w) for w in deployment.workers or []]
    for worker in workers:
        worker["ready"] = False
        if not (worker.get("pid") and is_alive(worker["pid"], deployment.model_dir)):
            _reap(worker.get("pid"))
            worker["pid"] = None
        elif not worker.get("signalled"):
            os.kill(worker["pid"], signal.SIGTERM)
            worker["signalled"] = True
    deployment.workers = workers
    if not any(w.get("pid") for w in workers):
        deployment.state, deployment.stopped_at = final, utcnow()


def _reap(pid: int | None) -> None:
    """Collect the exit status of a replica this server started (else it stays a zombie)."""
    if pid:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # started by an earlier server: its parent is gone, init collects it
