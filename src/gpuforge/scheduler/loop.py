"""The server's scheduling loop: one `tick()` every half second, in a thread of the server.

A tick, in one transaction:
1. every running job: ingest its run directory (store/ingest.py); a cancel asked for sends SIGTERM once
   (the runner checkpoints and exits); a process that is gone ends the job, by the last event it wrote:
   finished, failed, cancelled, paused (its cost budget spent), or, with no ending event: failed at once
   with the runner's one-line error when it refused its input (exit 2: it would refuse it again), else
   (killed, OOM-killed) queued again to resume from its last checkpoint while `restarts < max_restarts`;
2. deployments (scheduler/deployments.py): replicas started, restarted, checked, stopped; then searches
   (scheduler/searches.py): trials' evaluations told to their studies, trials pruned, new trials queued;
3. the queue, in three phases: a snapshot of what it reads (scheduler/snapshot.py), the pure plan_starts()
   on the devices no running job or deployment holds, and one apply step: jobs rejected, held, preempted,
   and each job to start claimed, its spec written beside its run directory and its runner started by the
   executor with its devices' environment.
The executor (scheduler/executor.py's protocol, built once by the server) says where the runners' ranks run,
which devices there are, and what the ledger charges; the loop never asks which executor it is.
The store is the truth the next tick reads, so a tick can fail (the store busy, a launch refused) and
the next one carries on. It is also what a restarted server starts from: a job the store says is running
is re-attached when its pid still runs its run directory, and otherwise ends or is re-queued as above,
so a server killed with SIGKILL loses nothing its jobs wrote. Each change of a job's state is a move of
store/states.py: it happens only while the job is still in the state it leaves (the API writes jobs too).
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.child_env import child_environment
from gpuforge.policy import Policy
from gpuforge.runs import RunDir
from gpuforge.runtime.host import is_alive
from gpuforge.scheduler import deployments
from gpuforge.scheduler.allocator import DeviceInfo, job_environment
from gpuforge.scheduler.autoscale import Autoscaler
from gpuforge.scheduler.budgets import ProjectBudgets
from gpuforge.scheduler.energy_use import EnergyUse
from gpuforge.scheduler.executor import BAD_INPUT_EXIT, Executor, Launched
from gpuforge.scheduler.queue import HELD, Plan
from gpuforge.scheduler.searches import Searches
from gpuforge.scheduler.sharing import Isolation, as_batch_work, cores_in, isolation_for
from gpuforge.scheduler.snapshot import QueueSnapshot, read_queue
from gpuforge.scheduler.traffic import Traffic
from gpuforge.scheduler.usage import HALF_LIFE_S, recent_usage
from gpuforge.scheduler.worker_keys import replicas_key
from gpuforge.settings import as_environment, current
from gpuforge.store import ledger, states
from gpuforge.store.db import session
from gpuforge.store.ingest import bad_input_error, ingest
from gpuforge.store.models import (
    LIVE_DEPLOYMENT_STATES,
    ApiKey,
    Deployment,
    Device,
    Event,
    Job,
    JobState,
    utcnow,
)
from gpuforge.track import JOB_ID_VARIABLE

log = logging.getLogger("gpuforge.scheduler")
TICK_S = 0.5
USAGE_REFRESH_S = 10.0
TROUBLE_LOG_S = 60.0  # a job whose watch fails every tick is logged this often, not twice a second
DEVICES_REFRESH_S = 60.0  # an executor's devices that change (a cluster's nodes) read again this often
PREEMPTED_BY = re.compile(r"preempted by job \d+.*?\(priority -?\d+\)")  # the head of _preempt's reason


def _counted(devices: list[DeviceInfo]) -> str:
    kinds = Counter(d.kind for d in devices)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "none"


def _after_preemption(state: JobState, reason: str | None, why: str) -> str:
    """Why a queued job waits; a preempted one keeps saying who preempted it, ahead of that."""
    found = PREEMPTED_BY.match(reason or "") if state == JobState.PREEMPTED else None
    return f"{found.group(0)}; {why}" if found else why


def _no_user_code(key: ApiKey | None) -> Policy:
    return Policy(user_code=False, roots=())


@dataclass(frozen=True)
class SchedulerOptions:
    """What the server's settings tell its scheduler (server/app.py builds it from Settings)."""

    deployments_dir: Path = Path("deployments")
    policy_of: Callable[[ApiKey | None], Policy] = _no_user_code  # what a key's jobs and replicas may do
    worker_secret: bytes | None = None  # replicas' keys derive from it; None: one for this process alone
    runner_env: Mapping[str, str] = field(default_factory=dict)  # Settings.runner_environment
    half_life_s: float = HALF_LIFE_S  # fair share's
    max_preemptions: int = 3  # preempted this often in a row: lifted to its preemptor's priority
    runs_dir: Path | None = None  # where jobs' models lie (default: beside deployments_dir)
    replica_ports: range | None = None  # None: any free port
    home: Path | None = None  # its prices.yaml and devices.yaml: the watts an energy estimate uses


class Scheduler:
    def __init__(
        self, engine, devices: list[DeviceInfo], executor: Executor, options: SchedulerOptions | None = None
    ):
        options = options or SchedulerOptions()
        deployments_dir = options.deployments_dir
        self.engine, self.devices, self.deployments_dir = engine, devices, deployments_dir
        self.executor = executor  # where runners' ranks run, its devices, what the ledger charges
        self.runner_env = dict(options.runner_env)  # where jobs' processes run (Settings.runner_environment)
        self.policy_of = options.policy_of  # what a key's jobs and replicas may do (settings.job_policy)
        # replicas' keys derive from it (scheduler/worker_keys.py); the server passes its kept one
        self.worker_secret = options.worker_secret or secrets.token_bytes(32)
        self.launched: dict[int, Launched] = {}  # this server's own children (others: re-attached by pid)
        self.told_unreadable: dict[int, float] = {}  # job -> when its unreadable lines were last logged
        self.troubled: dict[int, float] = {}  # job -> when its last failed watch was logged (_job_trouble)
        self.seen_alive: set[int] = set()  # running jobs whose process this server saw alive at its last tick
        self.signalled: set[int] = set()
        self.tick_seconds: list[float] = []  # recent tick durations, for /metrics (scheduling latency)
        self.half_life_s, self.max_preemptions = options.half_life_s, options.max_preemptions
        self.queue_positions: dict[int, int] = {}  # queued job id -> its place (1: next), at the last tick
        self.preempted_for: dict[
            int, tuple[int, int]
        ] = {}  # victim -> (the job it made room for, its priority)
        self.budgets = ProjectBudgets()
        self.traffic = Traffic()  # the forwarder's counts: the autoscaler's load
        self.keeper = deployments.Keeper(
            devices, deployments_dir, self.replica_env,
            replica_key=lambda d: replicas_key(self.worker_secret, d),
            adapters_root=options.runs_dir or deployments_dir.parent / "runs",  # where jobs' models lie
            autoscaler=Autoscaler(self.traffic), share_isolation=self.share_isolation,
            ports=options.replica_ports,
        )  # fmt: skip
        self.searches = Searches(engine, options.runs_dir or deployments_dir.parent / "runs")
        self.energy = EnergyUse(devices, options.home)  # measured once a tick, charged by the ledger
        self._usage_read: tuple[float, tuple[dict, dict]] | None = None
        self._last_tick: float | None = None
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        # a cluster's devices, read again in a thread of their own (a slow sinfo must not hold a tick up)
        self._read_devices: list[DeviceInfo] | None = None
        self._devices_lock = threading.Lock()  # the read handed from its thread to the tick's

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuforge-scheduler", daemon=True)
        self._thread.start()
        if self.executor.rereads_devices:
            threading.Thread(target=self._reread_devices, name="gpuforge-devices", daemon=True).start()
        self.executor.watch(self._stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def wake(self) -> None:
        """Tick now rather than at the next half second (a job was submitted, resumed or cancelled, a
        project changed: its budget is read again)."""
        self.budgets.read_again()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end scheduling; the next one retries
                log.exception("scheduling tick failed")
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _reread_devices(self) -> None:
        while not self._stop.wait(DEVICES_REFRESH_S):
            try:
                read = self.executor.devices()
                with self._devices_lock:
                    self._read_devices = read
            except Exception as err:  # the cluster unanswered: the devices known stay, the next read retries
                log.warning("devices not read again: %s", err)

    def _take_devices(self) -> None:
        """The devices read last, in place of those known (one list: the keeper and the routes share it)."""
        with self._devices_lock:
            read, self._read_devices = self._read_devices, None
        if read is None or read == self.devices:
            return
        log.info("devices now: %s (were %s)", _counted(read), _counted(self.devices))
        self.devices[:] = read

    # --- one pass ---
    def tick(self) -> None:
        began = time.perf_counter()
        self._take_devices()
        with session(self.engine) as s:
            running = list(s.scalars(select(Job).where(Job.state == JobState.RUNNING)))
            self._count_busy(s, running)
            live = list(s.scalars(select(Deployment).where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES))))
            now = utcnow()  # what the ledger charges to, and an ending seen this tick is dated
            alive = {j.id: self._alive(j) for j in running}  # asked before reading its files (_watch)
            charged = [j for j in running if self._ran_since_last_look(j, alive[j.id])]
            self.seen_alive = {job_id for job_id, yes in alive.items() if yes}
            self.executor.take_stock(running)  # before the ledger: the runs it charges within, if any
            within = {j.id: runs for j in charged if (runs := self.executor.runs_to_charge(j.id)) is not None}
            # a cluster's ranks run on its nodes: the runner's process here says nothing of their energy
            energy = self.energy.measure([] if self.executor.launches_ranks else running, live)
            ledger.accrue(s, charged, live, now, within=within, energy=energy)
            self.budgets.refresh(s)
            watched = {j.id for j in charged}  # the others were found ended at this server's first look
            for job in running:
                try:
                    self._watch(s, job, alive[job.id], now, dated=job.id in watched)
                except Exception:  # one job's trouble stops no other job's tick: the ledger, cancels, starts
                    self._job_trouble(job)
            for said in (self.troubled, self.told_unreadable):  # of running jobs alone: no table grows
                for job_id in said.keys() - alive.keys():
                    del said[job_id]
            jobs_hold = {
                d: f"job {job.id}"
                for job in running
                if job.state == JobState.RUNNING and job.devices
                for d in job.devices.split(",")
            }
            job_shares: dict[str, float] = {}
            for job in running:
                if job.state == JobState.RUNNING and job.devices and job.device_share is not None:
                    job_shares[job.devices] = job_shares.get(job.devices, 0.0) + job.device_share
            # a device a stopping job frees goes to the queue's pass (the job it was preempted for), not
            # to a replica's fraction placed first: replicas are never preempted
            closing = {
                d
                for job in running
                if job.devices and (job.stop_requested or job.cancel_requested)
                for d in job.devices.split(",")
            }
            deployments.keep(s, jobs_hold, self.keeper, job_shares, closing)
            s.commit()  # what the tick did so far stands, whatever a search's pass does
            self.searches.keep(s)  # trials told, pruned, asked for: before the queue, which starts them
            self._start_queued(s)
        self.tick_seconds = [*self.tick_seconds[-999:], time.perf_counter() - began]

    def _count_busy(self, s: Session, running: list[Job]) -> None:
        """Add the time since the last tick to each device a running job holds (Device.busy_seconds)."""
        now = time.monotonic()
        elapsed, self._last_tick = (now - self._last_tick if self._last_tick else 0.0), now
        held = {
            d for job in running if job.devices for d in job.devices.split(",")
        } | deployments.held_devices(s)
        for device in self.devices:
            row = s.get(Device, device.id)
            if row is None:
                row = Device(id=device.id, kind=device.kind, name=device.name)
                row.memory_bytes = device.memory_bytes
                s.add(row)
            if device.id in held and elapsed:
                row.busy_seconds = (row.busy_seconds or 0.0) + elapsed

    def child_env(self, s: Session, owner_id: int | None, device_ids: list[str]) -> dict[str, str]:
        """The whole environment of a job's runner or a replica: the allow-listed part of the server's
        (child_env.py), its devices, its owner's policy (user code, data roots) and the server's executor."""
        by_id = {d.id: d for d in self.devices}
        owner = s.get(ApiKey, owner_id) if owner_id is not None else None
        policy = self.policy_of(owner)
        own = job_environment([by_id[d] for d in device_ids]) | policy.environment() | self.runner_env
        return child_environment(own)

    def replica_env(
        self, s: Session, deployment: Deployment, device: DeviceInfo, isolation: Isolation | None = None
    ) -> dict[str, str]:
        key = replicas_key(self.worker_secret, deployment)
        env = self.child_env(s, deployment.owner_id, [device.id]) | as_environment(api_key=key)
        return env | (isolation.environment if isolation is not None else {})

    def _watts_environment(self, device_id: str) -> dict[str, str]:
        """What its device draws, and from where, for the runner's energy estimate per step."""
        device = next((d for d in self.devices if d.id == device_id), None)
        watts = self.energy.watts_of(device) if device is not None else None
        if watts is None:
            return {}
        return {"GPUFORGE_DEVICE_WATTS": f"{watts[0]:g}", "GPUFORGE_DEVICE_WATTS_FROM": watts[1]}

    def share_isolation(self, s: Session, device_id: str, share: float) -> Isolation:
        """What a fraction `share` of `device_id` gets, beside the fractions running there (the cores they
        are pinned to: running jobs' isolation words, live replicas' entries)."""
        taken: set[int] = set()
        held_by_jobs = select(Job.isolation).where(
            Job.state == JobState.RUNNING, Job.devices == device_id, Job.device_share.is_not(None)
        )
        for said in s.scalars(held_by_jobs):
            taken |= cores_in(said)
        live = select(Deployment.workers).where(
            Deployment.state.in_(LIVE_DEPLOYMENT_STATES), Deployment.device_share.is_not(None)
        )
        for workers in s.scalars(live):
            for w in workers or ():
                if w.get("pid") and w.get("device") == device_id:
                    taken |= cores_in(w.get("isolation"))
        by_id = {d.id: d for d in self.devices}
        return isolation_for(by_id[device_id], share, taken, current().mps)

    def _alive(self, job: Job) -> bool:
        own = self.launched.get(job.id)
        if own is not None and own.process is not None:
            return own.process.poll() is None  # reaps our child, keeping its exit code
        return is_alive(job.pid, job.run_dir)  # re-attached after a server restart: check it is ours

    def _ran_since_last_look(self, job: Job, alive: bool) -> bool:
        """Whether `job` ran at some moment since this server's last tick, so that its time up to this
        tick is charged: it runs now, or this server saw it run at its last tick or launched it (it ended
        since: charged to the tick that sees it ended, its finished_at, however long that tick was in
        coming). A process found ended at a server's first look may have died at any moment no server
        watched: _unwatched_end dates and charges it."""
        if job.run_started_at is None:
            return False  # claimed, its process not started yet
        return alive or job.id in self.seen_alive or job.id in self.launched

    def _watch(
        self, s: Session, job: Job, alive: bool | None = None, now: datetime | None = None, dated: bool = True
    ) -> None:
        """One running job this tick: `alive` was asked before its files are read (an ended process has
        written all it will; asked here when not given). An ending is dated `now` (default: now), the time
        the ledger charged it to; or, where this server never saw it run (`dated` False: it ended while no
        server watched), by _unwatched_end."""
        alive = self._alive(job) if alive is None else alive
        now = now or utcnow()
        if unreadable := sum(1 for e in ingest(s, job) if e.kind == "unreadable"):
            self._say_unreadable(job, unreadable)
        # `alive` is False for a pid that no longer runs this job's directory: that pid is not signalled
        if alive and (why := self._stop_for(job, self.executor.holds_devices_since(job))) is not None:
            if states.request_stop(s, job.id, *why):
                s.commit()
        if (job.cancel_requested or job.stop_requested) and alive:
            self._signal(job)
        if alive:
            return
        # the runner's last word on its run (a `compressed` event may follow `finished`); the server's
        # `preempted` closes the run before: its `cancelled` must not end a resumed runner that died unheard
        last = s.scalar(
            select(Event)
            .where(Event.job_id == job.id, Event.kind.in_(["started", "preempted", *states.RUNNER_ENDINGS]))
            .order_by(Event.seq.desc())
            .limit(1)
        )
        if not dated:
            now = self._unwatched_end(s, job, now)
        own = self.launched.pop(job.id, None)
        exit_code = own.process.returncode if own is not None and own.process is not None else None
        self.signalled.discard(job.id)
        server_stop = job.stop_requested and not job.cancel_requested
        if server_stop and (last is None or last.kind in ("started", "cancelled", "preempted")):
            self._stopped_by_server(s, job)  # it checkpointed on our SIGTERM (or died on the way)
        elif last is not None and last.kind in states.RUNNER_ENDINGS:
            states.end(s, job.id, last.kind, last.data.get("reason"), at=now)
        elif (refused := self._refused_input(job, exit_code)) is not None:
            states.fail(s, job.id, refused, at=now)
        elif job.restarts < job.max_restarts:
            why = f"process ended without a word (restart {job.restarts + 1} of {job.max_restarts})"
            states.requeue(s, job.id, why)
        else:
            states.fail(s, job.id, f"process ended without a word {job.restarts + 1} times", at=now)
        if job.reason:
            log.info("job %d: %s (%s)", job.id, job.state, job.reason)
        else:
            log.info("job %d: %s", job.id, job.state)

    def _unwatched_end(self, s: Session, job: Job, now: datetime) -> datetime:
        """When a job found ended at this server's first look ended, charged to it: its runner's last event
        (its own clock: a hint, not a measure), held between what was charged already and now. A job
        that wrote a wrong time can move it within the time no server watched, and no further."""
        said = s.scalar(
            select(Event.ts)
            .where(Event.job_id == job.id, Event.kind != "unreadable")  # those are dated by the server
            .order_by(Event.seq.desc())
            .limit(1)
        )
        charged = job.accrued_at or job.run_started_at or now
        ended = now if said is None else min(now, max(charged, _utc(said)))
        ledger.charge_job(s, job, ended, within=self.executor.runs_to_charge(job.id))  # as accrue's
        return ended

    def _say_unreadable(self, job: Job, count: int) -> None:
        """Log that a job's files held lines it could not read (each an `unreadable` event), once a minute
        a job at most: a job writing garbage fills no log."""
        last = self.told_unreadable.get(job.id)
        if last is not None and time.monotonic() - last < TROUBLE_LOG_S:
            return
        log.warning("job %d: %d unreadable line(s) in its run files skipped (gpuforge job %d: its events)",
                    job.id, count, job.id)  # fmt: skip
        self.told_unreadable[job.id] = time.monotonic()

    def _job_trouble(self, job: Job) -> None:
        """Log a failure to watch `job` (its traceback the first time, then once a minute at most): the
        job keeps its state, and the next tick tries it again."""
        last = self.troubled.get(job.id)
        if last is not None and time.monotonic() - last < TROUBLE_LOG_S:
            return
        log.warning("job %d: not watched this tick", job.id, exc_info=last is None)
        self.troubled[job.id] = time.monotonic()

    def _usage(self, s: Session) -> tuple[dict, dict]:
        """Device-time lately by key and by project (usage.py), read again every USAGE_REFRESH_S: it moves
        by a minute's worth at most meanwhile, and a read covers hours of the ledger."""
        if self._usage_read is None or time.monotonic() - self._usage_read[0] > USAGE_REFRESH_S:
            self._usage_read = (time.monotonic(), recent_usage(s, half_life_s=self.half_life_s))
        return self._usage_read[1]

    def _preempt(self, s: Session, victim_id: int, for_job: Job) -> None:
        """Stop a running job at its next checkpoint for `for_job`; it goes back to the queue once stopped."""
        of = f" of project {for_job.project}" if for_job.project else ""
        reason = f"preempted by job {for_job.id}{of} (priority {for_job.priority + for_job.boost})"
        if states.request_stop(s, victim_id, "preempt", reason):
            s.commit()
            self.preempted_for[victim_id] = (for_job.id, for_job.priority + for_job.boost)
            victim = s.get(Job, victim_id)
            if victim is not None and victim.pid and self._alive(victim):
                self._signal(victim)
            log.info("job %d: %s", victim_id, reason)

    def _signal(self, job: Job) -> None:
        """Stop a job's runner once (SIGTERM): it checkpoints at its next step and exits."""
        if job.id in self.signalled or not job.pid:
            return
        self.executor.stop_runner(job.pid)
        self.signalled.add(job.id)

    def _stop_for(self, job: Job, began: datetime | None) -> tuple[str, str] | None:
        """Why the server stops a running job now, when nobody asked yet: its project's budget is spent,
        or it ran past its resources.max_time since `began` (the executor's holds_devices_since).
        (Preemption is decided by the queue: _start_queued.)"""
        if job.stop_requested or job.cancel_requested or job.pid is None:
            return None
        if (spent := self.budgets.spent.get(job.project_id)) is not None:
            return "pause", f"paused: {spent}"
        if job.max_time_s and began is not None:
            ran = (utcnow() - began).total_seconds()
            if ran > job.max_time_s:
                return "timeout", f"paused: resources.max_time ({job.max_time_s:g} s) run"
        return None

    def _stopped_by_server(self, s: Session, job: Job) -> None:
        """A job the server stopped has ended its process: preempted back into the queue, pruned (a
        search's trial), or paused."""
        if job.stop_requested == "prune":
            if not states.prune(s, job.id, job.reason or "pruned"):
                states.end(s, job.id, "cancelled", None)  # a cancel landed meanwhile: its reason stays
            return
        if job.stop_requested != "preempt":
            if not states.pause(s, job.id, job.reason or "paused by the server"):
                states.end(s, job.id, "cancelled", None)  # a cancel landed meanwhile: its reason stays
            return
        by, priority = self.preempted_for.pop(job.id, (None, None))
        boost = None
        if job.preemptions + 1 >= self.max_preemptions and priority is not None:
            boost = max(0, priority - job.priority)  # preempted too often: it queues beside its preemptor
        if not states.preempt(s, job.id, job.reason or "preempted", boost):
            states.end(s, job.id, "cancelled", None)  # a cancel landed meanwhile: its reason stays
            return
        RunDir(Path(job.run_dir)).event("preempted", by_job=by, reason=job.reason)
        ingest(s, job)  # into the store now: only a running job's directory is read otherwise

    @staticmethod
    def _refused_input(job: Job, exit_code: int | None) -> str | None:
        """Why the runner refused its input (a spec or data error: exit 2), or None when it did not. Never
        retried: it would refuse it again. A process re-attached after a server restart has no exit code:
        a log that ends on the runner's error line says the same."""
        if exit_code == BAD_INPUT_EXIT:
            return bad_input_error(job.run_dir, job.files) or (
                f"the runner refused its input (exit {BAD_INPUT_EXIT}); see gpuforge logs {job.id}"
            )
        if exit_code is None:
            return bad_input_error(job.run_dir, job.files, last_line_only=True)
        return None

    # --- the queue: snapshot -> plan -> apply ---
    def _start_queued(self, s: Session) -> None:
        snapshot = self.read_queue(s)
        self.apply(s, snapshot, snapshot.plan())

    def read_queue(self, s: Session) -> QueueSnapshot:
        """Phase 1: what the queue pass reads (scheduler/snapshot.py)."""
        usage = lambda: self._usage(s)  # noqa: E731 (read only when fair share matters)
        return read_queue(s, self.devices, self.budgets, self.executor.holds_devices_since, usage, utcnow())

    def apply(self, s: Session, snapshot: QueueSnapshot, plan: Plan) -> None:
        """Phase 3: write what `plan` (plan_starts on `snapshot`) decided: jobs that can never start are
        rejected, those that wait say why, victims are asked to stop, and each job to start is claimed,
        then its runner started."""
        started = {job_id for job_id, _ in plan.starts}
        self.queue_positions = {
            job_id: place for place, job_id in enumerate((i for i in plan.order if i not in started), 1)
        }
        for job_id, why in plan.impossible.items():
            states.reject(s, job_id, why)
        waits = plan.held | plan.blocked
        for job_id, why in waits.items():  # says why it waits (written when it changes)
            state, reason = snapshot.shown[job_id]
            why = _after_preemption(state, reason, why)
            if reason != why:
                states.hold(s, job_id, why)
        for job_id, (_, reason) in snapshot.shown.items():  # a wait that no longer holds: its place says it
            if reason and reason.startswith(HELD) and job_id not in waits and job_id not in started:
                states.hold(s, job_id, None)
        for victim_id, for_job in plan.preempt.items():
            self._preempt(s, victim_id, s.get(Job, for_job))
        for job_id, device_ids in plan.starts:
            self._claim_and_start(s, job_id, device_ids, backfilled=job_id in plan.backfilled)

    def _claim_and_start(self, s: Session, job_id: int, device_ids: list[str], backfilled: bool) -> None:
        # Claim it first, only if it is still queued (a cancel may have landed since the read), and
        # commit: the store says `running` before the process exists, never the other way round. A
        # server that dies between the two finds a running job with no pid: restarted, as if killed.
        share = s.scalar(select(Job.device_share).where(Job.id == job_id))
        isolation = (
            as_batch_work(self.share_isolation(s, device_ids[0], share)) if share is not None else None
        )
        said = isolation.said if isolation is not None else None
        claimed = states.claim(s, job_id, device_ids, waiting_reason=HELD, isolation=said)
        if backfilled:
            log.info("job %d backfilled: it should end before the blocked job could start", job_id)
        s.commit()
        if not claimed:
            return
        job = s.get(Job, job_id, populate_existing=True)
        run_dir = Path(job.run_dir)
        spec_path = run_dir.with_name(run_dir.name + ".yaml")
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(job.spec_yaml)
        env = self.child_env(s, job.owner_id, device_ids) | {JOB_ID_VARIABLE: str(job.id)}  # its id
        if isolation is not None:
            env |= isolation.environment
        env |= self._watts_environment(device_ids[0])
        launched = self.executor.start_runner(spec_path, run_dir, env)
        self.launched[job.id] = launched
        states.start(s, job.id, launched.pid)
        s.commit()
        log.info("job %d started on %s (pid %d)", job.id, job.devices, launched.pid)


def _utc(unix_time: float) -> datetime:
    return datetime.fromtimestamp(unix_time, UTC)
