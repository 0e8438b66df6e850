"""The server's hyperparameter searches: one pass a tick, after the running jobs are watched and before the
queue is planned, so that a trial asked for starts in the same tick.

For each running search:
1. its trials (jobs with its search_id) that run: their new evaluations told to its study (read from their
   metrics.jsonl, untrusted lines skipped); one the pruner condemns is stopped (stop_requested `prune`:
   the loop sends SIGTERM, and the job ends `pruned` with the figures that condemned it);
2. its trials that ended and that the study still holds as running: told how (finished with their
   objective, pruned, stopped, failed), with what the ledger charged them;
3. its spend (the ledger's, over its trials) against its budget; a stop asked for (`gpuforge tune stop`)
   or a budget reached stops its trials (queued ones cancelled, running ones stopped at a checkpoint:
   paused) and, once none runs, ends it `stopped` or `budget_spent`;
4. new trials while fewer than `parallel` are queued or running and fewer than `max_trials` were asked:
   each a job like the one the search was admitted with (its owner, project, priority, devices, rate),
   with its spec's values set, queued like any job (quotas of devices, fair share, preemption apply).

The study lives in Optuna's tables (study_storage): a SQLite file beside the server's, or a schema of its
own in the server's PostgreSQL database (Optuna's tables and its alembic version table must not meet the
store's). The store is written first where the two must agree: a trial the study asked for and the
store never got (a server killed between) is found running in the study with no job, and gets its job
at the next pass; no trial is asked twice, none is lost.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from gpuforge.errors import GpuforgeError
from gpuforge.search.report import describe
from gpuforge.search.study import SearchStudy
from gpuforge.spec import JobSpec, SearchSpec, check_search, parse_spec, parse_tune
from gpuforge.store import searches, states
from gpuforge.store.models import QUEUE_JOB_STATES, ApiKey, Job, JobState, Search, SearchState
from gpuforge.store.quotas import QuotaExceeded, check_job

log = logging.getLogger("gpuforge.scheduler")
STUDIES_SCHEMA = "gpuforge_studies"  # PostgreSQL: Optuna's tables, apart from the store's
TROUBLE_LOG_S = 60.0
MAX_FAILED_PASSES = 20  # a search whose pass fails this many ticks in a row ends `failed`
ACTIVE = (*QUEUE_JOB_STATES, JobState.RUNNING)
STOPPED_BY_SEARCH = "stopped: the search"  # the reason a trial's pause starts with when its search stopped it
TRIAL_ENDINGS = {  # a trial job's end, as the study's trial ends
    JobState.FINISHED: "finished",
    JobState.PRUNED: "pruned",
    JobState.PAUSED: "stopped",
    JobState.CANCELLED: "stopped",
    JobState.FAILED: "failed",
}


def study_storage(engine: Engine) -> optuna.storages.BaseStorage:
    """Where a server's studies live: beside its store, never in the store's own tables."""
    url = engine.url
    if url.get_backend_name() == "sqlite":
        if not url.database or url.database == ":memory:":
            return optuna.storages.InMemoryStorage()
        path = Path(url.database)
        return optuna.storages.RDBStorage(f"sqlite:///{path.with_name(path.stem + '-studies.db')}")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {STUDIES_SCHEMA}"))
    return optuna.storages.RDBStorage(
        url.render_as_string(hide_password=False),
        engine_kwargs={"connect_args": {"options": f"-csearch_path={STUDIES_SCHEMA}"}, "pool_pre_ping": True},
    )


def search_spec(search: Search) -> SearchSpec:
    """A stored search's spec: the tune section and the job as admitted (checked again: cheap)."""
    tune = parse_tune(yaml.safe_load(search.tune_yaml), f"search {search.id}")
    raw = yaml.safe_load(search.job_yaml)
    job = parse_spec(copy.deepcopy(raw), Path("."), origin=f"search {search.id}")
    assert isinstance(job, JobSpec)
    return check_search(tune, job, raw)


def _ended(job: Job) -> bool:
    """Whether a trial's job has ended for its search: ended for good, or paused by its search. A trial
    paused for another reason (its project's budget, its max_time) waits to be resumed: not ended."""
    if job.state == JobState.PAUSED:
        return (job.reason or "").startswith(STOPPED_BY_SEARCH)
    return job.state in TRIAL_ENDINGS


def _total(spend: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """The trials' dollars and device-seconds, summed."""
    return sum(u for u, _ in spend.values()), sum(d for _, d in spend.values())


def study_name(search_id: int) -> str:
    return f"search-{search_id}"


@dataclass
class _Watched:
    offset: int = 0  # how far the trial's metrics.jsonl has been read (0 after a restart: told steps skip)


class Searches:
    def __init__(self, engine: Engine, runs_dir: Path):
        self.engine, self.runs_dir = engine, runs_dir
        self._storage: optuna.storages.BaseStorage | None = None
        self._studies: dict[int, SearchStudy] = {}
        self._watched: dict[int, _Watched] = {}  # trial job id -> what was read of it
        self._troubled: dict[int, float] = {}
        self._failures: dict[int, int] = {}  # search id -> passes failed in a row
        self._lock = threading.Lock()  # the loop's thread and the routes' open studies: once each

    def study(self, search: Search) -> SearchStudy:
        """The search's study (kept for the next pass while the search runs)."""
        with self._lock:
            if self._storage is None:
                self._storage = study_storage(self.engine)
            study = self._studies.get(search.id)
            if study is None:
                study = SearchStudy(search_spec(search), self._storage, study_name(search.id))
                if search.state == SearchState.RUNNING:
                    self._studies[search.id] = study
            return study

    def keep(self, s: Session) -> None:
        for search in searches.running_searches(s):
            try:
                self._keep(s, search)
                s.commit()
                self._failures.pop(search.id, None)
            except Exception as err:  # one search's trouble stops no other's, nor the tick
                s.rollback()
                self._trouble(s, search, err)

    def _trouble(self, s: Session, search: Search, err: Exception) -> None:
        """Log a pass that failed (its traceback once, then once a minute); past MAX_FAILED_PASSES in a row
        the search ends `failed`, saying why, and its trials stop: it cannot be kept."""
        failures = self._failures[search.id] = self._failures.get(search.id, 0) + 1
        last = self._troubled.get(search.id)
        if last is None or time.monotonic() - last > TROUBLE_LOG_S:
            log.warning("search %d: not kept this tick", search.id, exc_info=last is None)
            self._troubled[search.id] = time.monotonic()
        if failures < MAX_FAILED_PASSES:
            return
        why = f"could not be kept {failures} ticks in a row: {type(err).__name__}: {err}"[:500]
        try:
            self._stop_trials(s, [j for j in searches.trials_of(s, search.id) if j.state in ACTIVE], why)
            states.end_search(s, search.id, SearchState.FAILED, why)
            s.commit()
            self._studies.pop(search.id, None)
            log.warning("search %d: failed: %s", search.id, why)
        except Exception:
            s.rollback()

    def _keep(self, s: Session, search: Search) -> None:
        study = self.study(search)
        tune = study.search.tune
        trials = searches.trials_of(s, search.id)
        spend = searches.spend_by_job(s, [j.id for j in trials])
        untold = {t.number for t in study.running()}  # Optuna's own state: what drivers go by
        for job in trials:
            if job.state == JobState.RUNNING and not job.stop_requested:
                self._read(s, study, job)
            elif job.trial in untold and _ended(job):
                self._tell(study, job, spend.get(job.id, (0.0, 0.0)))
                self._watched.pop(job.id, None)
        active = [j for j in trials if not _ended(j)]
        spent = _total(spend)
        ending = self._ending(search, tune, spent)
        judged = [
            spend.get(j.id, (0.0, 0.0)) for j in trials if j.state in (JobState.FINISHED, JobState.PRUNED)
        ]
        cheapest = (min(u for u, _ in judged), min(d for _, d in judged)) if judged else None
        room = tune.budget.pays_for(*spent, cheapest)
        asked = len(study.study.get_trials(deepcopy=False))
        if ending is None and not active and not room and asked < tune.max_trials:
            ending = (
                SearchState.BUDGET_SPENT,
                (
                    f"what is left of its budget pays for no trial (the cheapest so far: ${cheapest[0]:.4f}, "
                    f"{cheapest[1]:.1f} device-s)"
                ),
            )
        if ending is not None:
            self._stop_trials(s, active, ending[1])
            if not active:
                have = {j.trial for j in trials}
                for number in untold - have:  # asked of the study, never queued: it ends with its search
                    study.finish(number, "stopped", reason=ending[1])
                states.end_search(s, search.id, *ending)
                self._studies.pop(search.id, None)
                log.info("search %d: %s (%s)", search.id, ending[0], ending[1])
            return
        if room:
            self._start_trials(s, search, study, trials, len(active))
        asked = len(study.study.get_trials(deepcopy=False))
        if not active and asked >= tune.max_trials and not study.running():
            states.end_search(s, search.id, SearchState.FINISHED, None)
            self._studies.pop(search.id, None)
            log.info("search %d: finished", search.id)

    def _read(self, s: Session, study: SearchStudy, job: Job) -> None:
        watched = self._watched.setdefault(job.id, _Watched())
        taken = study.take_evaluations(job.trial, Path(job.run_dir) / "metrics.jsonl", watched.offset)
        watched.offset = taken.offset
        if taken.prune is not None and states.request_stop(s, job.id, "prune", taken.prune):
            s.commit()  # the study has the evaluation that condemned it: the stop must not be lost
            log.info("job %d: %s", job.id, taken.prune)

    def _tell(self, study: SearchStudy, job: Job, spend: tuple[float, float]) -> None:
        ending = TRIAL_ENDINGS[job.state]
        value = study.final_value(job.trial, Path(job.run_dir)) if ending == "finished" else None
        usd, device_s = spend
        study.finish(job.trial, ending, value, job.reason, steps=job.step, cost_usd=usd, device_s=device_s)

    @staticmethod
    def _ending(search: Search, tune, spent: tuple[float, float]) -> tuple[SearchState, str] | None:
        """A stop asked for, or the budget spent (`spent`: the trials' dollars and device-seconds)."""
        if search.stop_requested:
            return SearchState.STOPPED, "stopped by `gpuforge tune stop`"
        why = tune.budget.spent(*spent)
        return (SearchState.BUDGET_SPENT, why) if why is not None else None

    @staticmethod
    def _stop_trials(s: Session, active: list[Job], why: str) -> None:
        for job in active:
            if job.state == JobState.RUNNING:
                if not job.stop_requested and not job.cancel_requested:
                    states.request_stop(s, job.id, "pause", f"{STOPPED_BY_SEARCH} {why}")
            elif job.state != JobState.PAUSED:
                states.cancel(s, job.id, f"not started: the search {why}")
            else:  # paused for another reason (its project's budget): the search's end ends it
                states.cancel(s, job.id, f"cancelled: the search {why}")

    def _start_trials(self, s: Session, search: Search, study: SearchStudy, trials: list[Job], active: int):
        tune = study.search.tune
        have = {j.trial for j in trials}
        # asked by the study but never stored (a server killed between the two): their jobs first
        orphans = [t for t in study.running() if t.number not in have]
        while active < tune.parallel:
            if not orphans and len(study.study.get_trials(deepcopy=False)) >= tune.max_trials:
                return
            refused = self._refused(s, search, study.search)
            if refused is not None:  # the key's quotas (its trials are its jobs), or the key revoked
                states.hold_search(s, search.id, refused)
                return
            if orphans:
                frozen = orphans.pop(0)
                number, params = frozen.number, dict(frozen.params)
            else:
                number, params = study.ask()
            try:
                self._queue_trial(s, search, study.search, number, params)
            except GpuforgeError as err:  # values that break a rule between keys: this trial alone fails
                study.finish(number, "failed", reason=f"its spec: {err}"[:1000])
                continue
            s.commit()  # the store holds the trial before anything else is asked
            states.hold_search(s, search.id, None)
            active += 1

    @staticmethod
    def _refused(s: Session, search: Search, spec: SearchSpec) -> str | None:
        """Why the search's key may not queue a trial now, or None."""
        owner = s.get(ApiKey, search.owner_id) if search.owner_id is not None else None
        if owner is None or owner.revoked_at is not None:
            return "waiting: its key is revoked"
        try:
            check_job(s, owner, search.trial_job.get("priority", 0))
        except QuotaExceeded as err:
            return f"waiting: {err}"
        return None

    def _queue_trial(self, s: Session, search: Search, spec: SearchSpec, number: int, params: dict) -> Job:
        name = f"{search.name}-trial-{number:04d}"
        trial_spec = spec.trial_spec(params, name=name)
        job = Job(
            **search.trial_job, name=name, owner_id=search.owner_id, project_id=search.project_id,
            spec_yaml=trial_spec.to_yaml(), run_dir="", search_id=search.id, trial=number,
        )  # fmt: skip
        s.add(job)
        s.flush()
        job.run_dir = str(self.runs_dir / f"job-{job.id}")
        self._studies[search.id].note(number, job=job.id)
        log.info("search %d: trial %d queued as job %d", search.id, number, job.id)
        return job


def search_view(s: Session, study: SearchStudy, search: Search) -> dict:
    """What `gpuforge tune show ID` shows (search/report.py's document), each trial's state its job's
    (queued, running, pruned...) and its cost the ledger's, with the search's id, name and owner."""
    jobs = {j.trial: j for j in searches.trials_of(s, search.id)}
    spend = searches.spend_by_job(s, [j.id for j in jobs.values()])
    trials = []
    for record in study.trials():
        job = jobs.get(record.number)
        if job is not None:
            record.job, record.state = job.id, str(job.state)
            record.cost_usd, record.device_s = spend.get(job.id, (0.0, 0.0))
            record.steps = job.step if record.steps is None else record.steps
            record.reason = record.reason or job.reason
        elif record.state == "running":
            record.state = "queued"  # asked of the study this moment, its job being stored
        record.run = None  # a server's path: the job's id says where its files are read
        trials.append(record)
    doc = describe(study, {"state": str(search.state), "reason": search.reason}, study.search.tune, trials)
    return {"id": search.id, "name": search.name, "owner": search.owner, **doc}
