"""The system routes: is the process up (/healthz), does the store answer (/readyz), and Prometheus'
text of the server's own figures (/metrics: jobs by state, queue length, device busy seconds, scheduling
latency). /healthz and /readyz need no key; /metrics does unless GPUFORGE_PUBLIC_METRICS says otherwise
(server/auth.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Gauge, Summary, generate_latest

from gpuforge.server.schemas import Health
from gpuforge.server.services import services
from gpuforge.store import jobs
from gpuforge.store.db import answers, session
from gpuforge.store.models import QUEUE_JOB_STATES, JobState

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health)
def readyz(request: Request) -> Health | JSONResponse:
    """The store answers too."""
    try:
        answers(services(request).engine)
    except Exception as err:  # any store failure: not ready, and say why
        return JSONResponse({"status": f"store unreachable: {type(err).__name__}"}, 503)
    return Health(status="ready")


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> str:
    """Prometheus text: jobs by state, queue length, device busy seconds, scheduling latency."""
    registry = CollectorRegistry()
    by_state = Gauge("gpuforge_jobs", "jobs by state", ["state"], registry=registry)
    queued = Gauge("gpuforge_queue_length", "jobs waiting for devices", registry=registry)
    busy = Gauge("gpuforge_device_busy_seconds", "time jobs held it", ["device"], registry=registry)
    tick = Summary(
        "gpuforge_scheduling_tick_seconds", "one scheduling pass (recent ticks)", registry=registry
    )
    state = services(request)
    with session(state.engine) as s:
        counts = jobs.count_by_state(s)
        for device_id, seconds in jobs.device_busy_seconds(s):
            busy.labels(device_id).set(seconds)
    for job_state in JobState:
        by_state.labels(job_state.value).set(counts.get(job_state, 0))
    queued.set(sum(counts.get(job_state, 0) for job_state in QUEUE_JOB_STATES))
    for seconds in state.scheduler.tick_seconds if state.scheduler is not None else ():
        tick.observe(seconds)
    return generate_latest(registry).decode()
