"""The gpuforge server: FastAPI app factory.

    gpuforge server [--host 127.0.0.1] [--port 8600] [--db URL]     (uvicorn serves create_app())

On start it connects to the store, brings its schema up to date, takes stock of the devices, and on a
first start makes the admin key (written to $GPUFORGE_HOME/admin.key, mode 0600, and nowhere else).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Gauge, Summary, generate_latest
from sqlalchemy import func, select, text

from gpuforge.dashboard.pages import add_pages
from gpuforge.errors import GpuforgeError
from gpuforge.runtime.host import port_range
from gpuforge.scheduler.allocator import cluster_inventory, inventory, parse_labels, with_labels
from gpuforge.scheduler.loop import Scheduler
from gpuforge.scheduler.worker_keys import load_secret
from gpuforge.secret_files import shown_url
from gpuforge.server.auth import RequireKey
from gpuforge.server.routes import (
    deployment_versions,
    deployments,
    forward,
    jobs,
    keys,
    overview,
    profiles,
    projects,
    uploads,
)
from gpuforge.server.schemas import Health
from gpuforge.server.settings import Settings, job_policy
from gpuforge.settings import env_name
from gpuforge.store.db import connect, migrate, session
from gpuforge.store.keys import ensure_admin_key, has_admin_key
from gpuforge.store.models import QUEUE_JOB_STATES, Device, Job, JobState

log = logging.getLogger("gpuforge.server")
UPLOADS_PREFIX = uploads.router.prefix + "/"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    replica_ports = port_range(settings.replica_ports)  # a bad range stops the server before it starts

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.make_home()
        engine = open_store(settings)
        with session(engine) as s:
            admin = ensure_admin_key(s, settings.home, settings.admin_key)
        if admin:  # the key itself is in that file alone: a log is read by more people than the admin
            log.warning("admin API key made: it is in %s (mode 0600)", settings.home / "admin.key")
        app.state.engine, app.state.devices = engine, devices_of(settings)
        app.state.worker_secret = load_secret(settings.home)
        app.state.scheduler = Scheduler(
            engine,
            app.state.devices,
            settings.home / "deployments",
            policy_of=lambda key: job_policy(settings, key),
            worker_secret=app.state.worker_secret,
            runner_env=settings.runner_environment,
            half_life_s=settings.fair_share_half_life_s,
            max_preemptions=settings.max_preemptions,
            runs_dir=settings.runs_dir,
            # a Slurm partition's nodes come and go (drained, down, added): read again while serving
            devices_source=(lambda: devices_of(settings)) if settings.executor == "slurm" else None,
            holding_source=holding_source(settings),
            replica_ports=replica_ports,
        )
        if settings.schedule:
            app.state.scheduler.start()
        app.state.traffic = app.state.scheduler.traffic  # requests forwarded to replicas, not yet answered
        app.state.replica_readings = {}  # (deployment, replica) -> its counters at the last look (stats)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=5)) as app.state.http:
            yield
        app.state.scheduler.stop()
        engine.dispose()

    app = FastAPI(title="gpuforge", version="0.1.0", lifespan=lifespan)
    app.state.settings, app.state.known_keys, app.state.revoked_keys = settings, {}, set()
    app.state.open_streams = {}  # key id -> live streams it holds (routes/jobs.py)
    for routes in (jobs, profiles, keys, projects, uploads, deployments, deployment_versions, forward,
                   overview):  # fmt: skip
        app.include_router(routes.router)
    add_pages(app)

    app.add_middleware(
        RefuseLargeBodies, limit=settings.max_request_bytes, upload_limit=settings.max_body_bytes
    )
    app.add_middleware(RequireKey, fastapi_app=app, public_documents=settings.public_metrics)  # outermost

    @app.get("/healthz", response_model=Health, tags=["system"])
    def healthz() -> Health:
        """The process answers."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, tags=["system"])
    def readyz(request: Request) -> Health | JSONResponse:
        """The store answers too."""
        try:
            with request.app.state.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as err:  # any store failure: not ready, and say why
            return JSONResponse({"status": f"store unreachable: {type(err).__name__}"}, 503)
        return Health(status="ready")

    @app.get("/metrics", response_class=PlainTextResponse, tags=["system"])
    def metrics(request: Request) -> str:
        """Prometheus text: jobs by state, queue length, device busy seconds, scheduling latency."""
        registry = CollectorRegistry()
        by_state = Gauge("gpuforge_jobs", "jobs by state", ["state"], registry=registry)
        queued = Gauge("gpuforge_queue_length", "jobs waiting for devices", registry=registry)
        busy = Gauge("gpuforge_device_busy_seconds", "time jobs held it", ["device"], registry=registry)
        tick = Summary(
            "gpuforge_scheduling_tick_seconds", "one scheduling pass (recent ticks)", registry=registry
        )
        with session(request.app.state.engine) as s:
            counts = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            for device_id, seconds in s.execute(select(Device.id, Device.busy_seconds)):
                busy.labels(device_id).set(seconds or 0.0)
        for state in JobState:
            by_state.labels(state.value).set(counts.get(state, 0))
        queued.set(sum(counts.get(state, 0) for state in QUEUE_JOB_STATES))
        for seconds in request.app.state.scheduler.tick_seconds:
            tick.observe(seconds)
        return generate_latest(registry).decode()

    return app


class RefuseLargeBodies:
    """413 for a request body over its limit (`upload_limit` for uploads, `limit` for anything else): at
    once by its Content-Length, and, for a body sent in chunks without one, as soon as the bytes read pass
    the limit (the route stops reading there). A plain ASGI middleware: @app.middleware("http") would wrap
    every request and response in extra tasks."""

    def __init__(self, app, limit: int, upload_limit: int):
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_limit if scope["path"].startswith(UPLOADS_PREFIX) else self.limit
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:  # refused unread, and the connection closed
            response = JSONResponse(
                {"detail": _too_large(int(length), limit)},
                status.HTTP_413_CONTENT_TOO_LARGE,
                headers={"Connection": "close"},
            )
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # an HTTPException: FastAPI answers it as it is
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, _too_large(received, limit))
            return message

        await self.app(scope, counted, send)


def _too_large(size: int, limit: int) -> str:
    return f"body of {size} bytes or more is over the {limit} allowed"


def open_store(settings: Settings):
    """Connect to the store and bring its schema up to date; a SQLite file is the server's alone (0600)."""
    engine = connect(settings.db_url)
    migrate(engine)
    database = engine.url.database
    if engine.url.get_backend_name() == "sqlite" and database and database != ":memory:":
        for path in (Path(database), Path(database + "-wal"), Path(database + "-shm")):
            if path.exists():
                path.chmod(0o600)
    return engine


def holding_source(settings: Settings) -> Callable[[], set[str] | None] | None:
    """Executor slurm: which jobs hold their nodes now, as Slurm says (the ledger's check on the runners'
    marks, scheduler/seen_holding.py); None for the other executors."""
    if settings.executor != "slurm":
        return None
    from gpuforge.launch.slurm import holding_logs_folders

    return holding_logs_folders


def devices_of(settings: Settings) -> list:
    """What the scheduler hands out: this machine's devices, or a Ray cluster's or a Slurm partition's (GPUs,
    and CPUs as slots). The scheduler tells job runners where they submit (Settings.runner_environment)."""
    try:
        labels = parse_labels(settings.device_labels)
    except ValueError as err:
        raise GpuforgeError(str(err)) from None
    if settings.executor == "local":
        return with_labels(inventory(), labels)
    if settings.executor == "slurm":
        from gpuforge.launch.slurm_partition import partition_nodes

        return with_labels(cluster_inventory({"per_node": partition_nodes(settings.slurm_partition)}), labels)
    from gpuforge.launch.ray_ranks import cluster_devices
    from gpuforge.launch.ray_ranks import connect as connect_ray

    connect_ray(settings.ray_address or "")
    return with_labels(cluster_inventory(cluster_devices()), labels)


def check_executor(settings: Settings) -> None:
    """Before listening: a Ray cluster that does not answer is one clear line, not a hang at the first job;
    so is a Slurm partition Slurm does not have, or whose nodes do not see the run directory (a probe job)."""
    if settings.executor != "slurm" and (chosen := settings.slurm_options()):
        names = ", ".join(env_name(name) for name in chosen)
        raise GpuforgeError(f"{names}: for --executor slurm (this server's is {settings.executor})")
    if settings.executor == "slurm":
        return _check_slurm(settings)
    if settings.executor != "ray":
        return
    if not settings.ray_address:
        raise GpuforgeError("--executor ray needs --ray-address HOST:PORT (the head node of the cluster)")
    from gpuforge.launch.ray_ranks import connect as connect_ray

    connect_ray(settings.ray_address)


def _check_slurm(settings: Settings) -> None:
    """The partition has nodes, and a probe job on one of them wrote into the run directory. A probe
    that passed is remembered in the home for the same directory and Slurm options: a restart does not
    wait again for a free node of a busy partition."""
    from gpuforge.launch.slurm import check_slurm
    from gpuforge.launch.slurm_partition import partition_name, partition_nodes, probe_shared

    options = {k.removeprefix("slurm_"): v for k, v in settings.slurm_options().items()}
    check_slurm(options)  # commands on PATH, names that are names, before any is run
    nodes = partition_nodes(settings.slurm_partition)
    # what the probe showed holds for this directory, on these nodes (the default partition may change)
    asked = {
        "runs_dir": str(settings.runs_dir.resolve()),
        **options,
        "partition": partition_name(settings.slurm_partition),
        "cluster": os.environ.get("SLURM_CONF"),
    }
    passed = settings.home / "slurm-probe.json"
    try:
        earlier = json.loads(passed.read_text())
    except (OSError, ValueError):
        earlier = {}
    if isinstance(earlier, dict) and earlier.get("asked") == asked:
        seen_from = earlier.get("node")
        log.info("Slurm: %d node(s); the run directory was seen from %s (%s)", len(nodes), seen_from, passed)
        return
    node = probe_shared(settings.runs_dir, options)
    try:
        passed.write_text(json.dumps({"asked": asked, "node": node}))
    except OSError as err:  # not remembered: the next start probes again
        log.warning("%s not written: %s", passed, err.strerror)
    log.info("Slurm: %d node(s); a probe job on %s wrote into %s", len(nodes), node, settings.runs_dir)


def check_store_and_bind(settings: Settings) -> None:
    """Before listening: the store opens (a bad --db is one line, not a traceback), and the server refuses
    to listen beyond loopback on a store with no admin key yet, unless GPUFORGE_ADMIN_KEY gives one: an
    open port should have its admin key decided before it opens, not made by its first start."""
    settings.make_home()
    try:
        engine = open_store(settings)
        with session(engine) as s:
            has_key = has_admin_key(s)
        engine.dispose()
    except Exception as err:  # any driver's error: say which store and why, never its password
        url = shown_url(settings.db_url)
        reason = str(err).splitlines()[0].replace(settings.db_url, url) if str(err) else type(err).__name__
        raise GpuforgeError(f"--db {url}: cannot open the store: {reason}") from None
    if not (settings.loopback_only or settings.admin_key or has_key):
        raise GpuforgeError(
            f"--host {settings.host}: refusing to listen beyond loopback with no API key configured; set "
            "GPUFORGE_ADMIN_KEY (gf_ and 32+ characters), or start once on 127.0.0.1 to make "
            f"{settings.home / 'admin.key'}"
        )
