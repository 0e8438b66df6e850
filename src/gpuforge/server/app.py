"""The gpuforge server: FastAPI app factory.

    gpuforge server [--host 127.0.0.1] [--port 8600] [--db URL]     (uvicorn serves create_app())

On start it connects to the store, brings its schema up to date, takes stock of the devices, and on a
first start makes the admin key (written to $GPUFORGE_HOME/admin.key, mode 0600, and nowhere else).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, status
from fastapi.responses import JSONResponse

from gpuforge.dashboard.pages import add_pages
from gpuforge.dashboard.read_routes import read_routes
from gpuforge.errors import GpuforgeError
from gpuforge.executors import build as build_executor
from gpuforge.notify.worker import Notifier, NotifierOptions
from gpuforge.runtime.host import port_range
from gpuforge.scheduler.energy_use import parse_intensity
from gpuforge.scheduler.executor import Executor
from gpuforge.scheduler.loop import Scheduler, SchedulerOptions
from gpuforge.scheduler.worker_keys import load_secret
from gpuforge.secret_files import shown_url
from gpuforge.server.auth import RequireKey
from gpuforge.server.job_reader import store_reader
from gpuforge.server.permissions import permit
from gpuforge.server.routes import (
    audit,
    deployment_versions,
    deployments,
    forward,
    jobs,
    keys,
    me,
    notifications,
    overview,
    profiles,
    projects,
    searches,
    system,
    uploads,
)
from gpuforge.server.services import Services
from gpuforge.server.settings import Settings, job_policy
from gpuforge.server.sso import session_router, single_sign_on
from gpuforge.settings import current
from gpuforge.store.db import connect, migrate, session
from gpuforge.store.keys import ensure_admin_key, has_admin_key

log = logging.getLogger("gpuforge.server")
UPLOADS_PREFIX = uploads.router.prefix + "/"


def create_app(settings: Settings | None = None, executor: Executor | None = None) -> FastAPI:
    """The app; `executor`: the one check_executor built and checked (else built here from the settings)."""
    settings = settings or Settings()
    replica_ports = port_range(settings.replica_ports)  # a bad range stops the server before it starts
    parse_intensity(current().grid_gco2e_per_kwh)  # as a bad grid intensity does (GpuforgeError, one line)
    executor = executor or build_executor(settings, settings.runs_dir)  # where its kind is read

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.make_home()
        engine = open_store(settings)
        with session(engine) as s:
            admin = ensure_admin_key(s, settings.home, settings.admin_key)
        if admin:  # the key itself is in that file alone: a log is read by more people than the admin
            log.warning("admin API key made: it is in %s (mode 0600)", settings.home / "admin.key")
        state.engine, state.devices = engine, executor.devices()
        state.worker_secret = load_secret(settings.home)
        options = scheduler_options(settings, state.worker_secret, replica_ports)
        state.scheduler = scheduler = Scheduler(engine, state.devices, executor, options)
        state.notifier = notifier = Notifier(engine, NotifierOptions(smtp=settings.smtp()))
        if settings.schedule:  # an API-only server sends only the tests asked of it (routes/notifications)
            scheduler.start()
            notifier.start()
        state.traffic = scheduler.traffic
        state.replica_readings = {}  # each start reads replicas afresh (routes/deployments stats)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=5)) as state.http:
            yield
        scheduler.stop()
        notifier.stop()
        engine.dispose()

    app = FastAPI(title="gpuforge", version="0.1.0", lifespan=lifespan)
    app.state.services = state = Services(settings)  # what the routes use (server/services.py)
    state.sso = single_sign_on(settings)
    if state.sso.oidc is not None:
        app.include_router(state.sso.oidc.router())
        app.include_router(session_router())
    app.include_router(read_routes(store_reader, permit))  # the jobs' reads, shared with `gpuforge dashboard`
    for routes in (jobs, searches, profiles, keys, projects, uploads, deployments, deployment_versions,
                   forward, overview, audit, me, system, notifications):  # fmt: skip
        app.include_router(routes.router)
    add_pages(app)

    app.add_middleware(
        RefuseLargeBodies, limit=settings.max_request_bytes, upload_limit=settings.max_body_bytes
    )
    app.add_middleware(RequireKey, fastapi_app=app, public_documents=settings.public_metrics)  # outermost

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


def scheduler_options(
    settings: Settings, worker_secret: bytes, replica_ports: range | None
) -> SchedulerOptions:
    """What the settings tell the scheduler; `worker_secret`: the one kept in the home (replicas' keys
    outlive a restart)."""
    return SchedulerOptions(
        deployments_dir=settings.home / "deployments",
        policy_of=lambda key: job_policy(settings, key),
        worker_secret=worker_secret,
        runner_env=settings.runner_environment,
        half_life_s=settings.fair_share_half_life_s,
        max_preemptions=settings.max_preemptions,
        runs_dir=settings.runs_dir,
        replica_ports=replica_ports,
        home=settings.home,
    )


def check_executor(settings: Settings) -> Executor:
    """Before listening: what the executor needs answers (a Ray cluster, a Slurm partition whose nodes see
    the run directory), one clear line if not, rather than a hang at the first job (executors/). The
    executor built, for create_app: built once."""
    executor = build_executor(settings, settings.runs_dir)
    executor.check()
    return executor


def check_store_and_bind(settings: Settings) -> None:
    """Before listening: the store opens (a bad --db is one line, not a traceback), and the server refuses
    to listen beyond loopback on a store with no admin key yet, unless GPUFORGE_ADMIN_KEY gives one: an
    open port should have its admin key decided before it opens, not made by its first start."""
    settings.smtp()  # a bad SMTP setting (its password file unreadable) is one line now, not a failed start
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
