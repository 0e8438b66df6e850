"""Hyperparameter searches: start one, list them, read one (its trials, best, importances, spend), stop one.

A search is admitted as its job would be (every rule of a submit: the key's policy, its files, the
devices, the price the server sets), then its tune section is checked against that job; each trial the
loop queues later (scheduler/searches.py) is that job with its values set."""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from fastapi import APIRouter, HTTPException, Path, Request, status

from gpuforge.admission import check_spec
from gpuforge.errors import GpuforgeError
from gpuforge.scheduler.searches import Searches, search_view
from gpuforge.server.auth import Key
from gpuforge.server.permissions import audited, permit
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.routes.jobs import wake_scheduler
from gpuforge.server.schemas import JobCreate, SearchCreate, SearchPublic
from gpuforge.server.services import services
from gpuforge.server.settings import job_policy
from gpuforge.server.submit import MAX_SPEC_BYTES, Server, admitted_job, spec_yaml
from gpuforge.server.visibility import check_change
from gpuforge.spec import JobSpec, check_search, parse_tune
from gpuforge.store import searches, states
from gpuforge.store.db import session
from gpuforge.store.models import Search
from gpuforge.store.quotas import INT32, check_job

router = APIRouter(prefix="/api/v1/searches", tags=["searches"])
SearchId = Annotated[int, Path(ge=1, le=INT32)]


def _unprocessable(message: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, message)


def _tune_and_job(body: SearchCreate) -> tuple[Any, dict]:
    """The tune section (from the spec, or sent beside it) and the job's raw spec, each read with bounded
    work."""
    for field, text in (("spec", body.spec), ("tune", body.tune or "")):
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"{field}: over {MAX_SPEC_BYTES} bytes")
    try:
        raw = spec_yaml(body.spec)
        sent = spec_yaml(body.tune) if body.tune is not None else None
    except (yaml.YAMLError, GpuforgeError) as err:
        raise _unprocessable(f"not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise _unprocessable("spec: a mapping of sections (model, data, train, tune, ...) expected")
    in_spec = raw.pop("tune", None)
    if in_spec is not None and sent is not None:
        raise _unprocessable("tune: the spec has a tune: section and another was sent beside it: give one")
    if in_spec is None and sent is None:
        raise _unprocessable("tune: no tune: section in the spec, and none sent beside it")
    return (in_spec if in_spec is not None else sent), raw


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SearchPublic,
    dependencies=[permit("searches.create")],
)
def create_search(body: SearchCreate, request: Request, key: Key) -> Search:
    """Start a search (201): refused (422) like a submit for its job, or for its tune section (a key the
    job lacks, a range it cannot take, an objective its evaluation does not report); nothing is stored
    then. Its trials are its key's jobs: quotas, priorities, fair share and budgets apply to each."""
    state = services(request)
    server = Server.of(state)
    tune_raw, raw = _tune_and_job(body)
    try:
        tune = parse_tune(tune_raw, "tune")
    except GpuforgeError as err:
        raise _unprocessable(str(err)) from err
    if tune.pruner.asha is not None and tune.pruner.asha.pause:
        raise _unprocessable(
            "tune.pruner.asha.pause: a server's trials are not paused at their rungs yet; leave it out here "
            "(it is for gpuforge tune --local)"
        )
    job_body = JobCreate(spec=yaml.safe_dump(raw), priority=body.priority, name=body.name, files=body.files)
    spec, template = admitted_job(job_body, key, server)
    if not isinstance(spec, JobSpec):
        raise _unprocessable("kind: script: a search varies a job gpuforge trains")
    try:
        search_spec = check_search(tune, spec, yaml.safe_load(spec.to_yaml()))
        policy = job_policy(state.settings, key)
        for name, parameter in tune.parameters.items():  # each value a trial may take, under the key's policy
            for value in parameter.probes():
                check_spec(policy, search_spec.trial_spec({name: value}))
    except GpuforgeError as err:
        raise _unprocessable(str(err)) from err
    trial_job = {
        column: getattr(template, column)
        for column in ("priority", "device_type", "devices_wanted", "device_share", "usd_per_hour",
                       "usd_per_kwh", "preemptible", "max_time_s", "placement", "files")
    }  # fmt: skip
    with session(state.engine) as s:
        with quota_refusal():  # one trial's worth now; each trial is counted as a job when queued
            check_job(s, key, template.priority)
        search = Search(
            name=template.name, owner_id=key.id, project_id=key.project_id,
            tune_yaml=yaml.safe_dump(tune.model_dump(mode="json", by_alias=True), sort_keys=False),
            job_yaml=spec.to_yaml(), trial_job=trial_job,
        )  # fmt: skip
        s.add(search)
        s.flush()
        s.refresh(search, ["owner"])
        audited(s, request, key, f"search {search.id}", search.project_id, after={"name": search.name})
    wake_scheduler(request)
    return search


@router.get("", response_model=list[SearchPublic], dependencies=[permit("searches.read")])
def list_searches(request: Request, key: Key) -> list[Search]:
    """The searches this key may read (its own, its project's; an admin's: all), newest first."""
    with session(services(request).engine) as s:
        return searches.searches_of(s, key)


def _visible(s, key, search_id: int) -> Search:
    search = searches.visible_search(s, key, search_id)
    if search is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"search {search_id}: no such search")
    return search


@router.get("/{search_id}", dependencies=[permit("searches.read")])
def read_search(search_id: SearchId, request: Request, key: Key) -> dict[str, Any]:
    """A search as `gpuforge tune show` shows it: its state, trials (parameters, state, objective, steps,
    cost, job), the best finished trial, importances, spend and what is left of its budget. Objectives
    are the trials' own evaluations; costs are the server's ledger."""
    state = services(request)
    with session(state.engine) as s:
        search = _visible(s, key, search_id)
        keeper = state.scheduler.searches if state.scheduler is not None else None
        keeper = keeper or Searches(state.engine, state.settings.runs_dir)
        return search_view(s, keeper.study(search), search)


@router.post("/{search_id}/stop", response_model=SearchPublic, dependencies=[permit("searches.stop")])
def stop_search(search_id: SearchId, request: Request, key: Key) -> Search:
    """Stop a search (its owner or an admin): its running trials stop at a checkpoint, its queued ones are
    cancelled, then it ends `stopped`. A search that has ended answers 409."""
    with session(services(request).engine) as s:
        search = _visible(s, key, search_id)
        check_change(key, search, "searches.stop", f"search {search_id}", search.owner)
        if not states.stop_search(s, search.id):
            raise HTTPException(status.HTTP_409_CONFLICT, f"search {search_id}: already {search.state}")
        s.refresh(search)
        audited(s, request, key, f"search {search_id}", search.project_id, after={"stop_requested": True})
    wake_scheduler(request)
    return search
