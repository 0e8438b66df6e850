"""The server's scheduling loop: one `tick()` every half second, in a thread of the server.

A tick, in one transaction:
1. every running job: ingest its run directory (store/ingest.py); a cancel asked for sends SIGTERM once
   (the runner checkpoints and exits); a process that is gone ends the job, by the last event it wrote:
   finished, failed, cancelled, or, with no ending event (killed, OOM-killed), queued again to resume
   from its last checkpoint while `restarts < max_restarts`;
2. the queue: plan_starts() on the devices no running job holds; each job to start gets its spec
   written beside its run directory and a runner process with its devices' environment.
The store is the truth the next tick reads, so a tick can fail (the store busy, a launch refused) and
the next one carries on.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.scheduler.allocator import DeviceInfo, job_environment
from gpuforge.scheduler.executor import Launched, is_alive, launch
from gpuforge.scheduler.queue import QueuedJob, plan_starts
from gpuforge.store.db import session
from gpuforge.store.ingest import ingest
from gpuforge.store.models import Event, Job, utcnow

log = logging.getLogger("gpuforge.scheduler")
TICK_S = 0.5
ENDINGS = {"finished": "finished", "failed": "failed", "cancelled": "cancelled"}


class Scheduler:
    def __init__(self, engine, devices: list[DeviceInfo]):
        self.engine, self.devices = engine, devices
        self.launched: dict[int, Launched] = {}  # this server's own children (others: re-attached by pid)
        self.signalled: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuforge-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end scheduling; the next one retries
                log.exception("scheduling tick failed")
            self._stop.wait(TICK_S)

    # --- one pass ---
    def tick(self) -> None:
        with session(self.engine) as s:
            running = list(s.scalars(select(Job).where(Job.state == "running")))
            for job in running:
                self._watch(s, job)
            self._start_queued(s)

    def _alive(self, job: Job) -> bool:
        own = self.launched.get(job.id)
        if own is not None and own.process is not None:
            return own.process.poll() is None  # reaps our child, keeping its exit code
        return is_alive(job.pid)

    def _watch(self, s: Session, job: Job) -> None:
        alive = self._alive(job)  # asked before reading: an ended process has written all it will
        ingest(s, job)
        if job.cancel_requested and job.id not in self.signalled and job.pid:
            try:
                os.kill(job.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.signalled.add(job.id)
        if alive:
            return
        last = s.scalar(select(Event).where(Event.job_id == job.id).order_by(Event.seq.desc()).limit(1))
        self.launched.pop(job.id, None)
        self.signalled.discard(job.id)
        job.pid = None
        if last is not None and last.kind in ENDINGS:
            job.state = ENDINGS[last.kind]
            job.finished_at = utcnow()
            job.reason = job.reason or last.data.get("reason")
        elif job.restarts < job.max_restarts:
            job.restarts += 1
            job.state, job.devices = "queued", None
            job.reason = f"process ended without a word (restart {job.restarts} of {job.max_restarts})"
        else:
            job.state, job.finished_at = "failed", utcnow()
            job.reason = f"process ended without a word {job.restarts + 1} times"
        log.info("job %d: %s (%s)", job.id, job.state, job.reason)

    def _start_queued(self, s: Session) -> None:
        held = {d for (devices,) in s.execute(select(Job.devices).where(Job.state == "running")) if devices
                for d in devices.split(",")}  # fmt: skip
        free: dict[str, list[str]] = {}
        total: dict[str, int] = {}
        for d in self.devices:
            total[d.kind] = total.get(d.kind, 0) + 1
            if d.id not in held:
                free.setdefault(d.kind, []).append(d.id)
        queued = s.execute(
            select(Job.id, Job.priority, Job.device_type, Job.devices_wanted).where(Job.state == "queued")
        )
        plan = plan_starts([QueuedJob(*row) for row in queued], free, total)
        by_id = {d.id: d for d in self.devices}
        for job_id, why in plan.impossible.items():
            job = s.get(Job, job_id)
            job.state, job.reason, job.finished_at = "failed", why, utcnow()
        for job_id, device_ids in plan.starts:
            job = s.get(Job, job_id)
            run_dir = Path(job.run_dir)
            spec_path = run_dir.with_name(run_dir.name + ".yaml")
            spec_path.parent.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(job.spec_yaml)
            launched = launch(spec_path, run_dir, job_environment([by_id[d] for d in device_ids]))
            self.launched[job.id] = launched
            job.state, job.pid, job.devices = "running", launched.pid, ",".join(device_ids)
            job.started_at = job.started_at or utcnow()
            log.info("job %d started on %s (pid %d)", job.id, job.devices, launched.pid)
