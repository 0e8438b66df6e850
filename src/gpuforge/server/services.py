"""The server's services, one typed object (`app.state.services`): what the routes, the auth gate and the
pages use, each named once with its type, instead of loose attributes of FastAPI's `app.state`.

Made with the app (its settings and the key caches); the store, the devices and the scheduler are set when
the app starts (server/app.py's lifespan): a request never comes before that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI, Request
    from sqlalchemy.engine import Engine

    from gpuforge.notify.worker import Notifier
    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.scheduler.traffic import Traffic
    from gpuforge.server.settings import Settings
    from gpuforge.server.sso import SingleSignOn
    from gpuforge.store.models import ApiKey


@dataclass
class Services:
    settings: Settings
    known_keys: dict[str, tuple[ApiKey, float]] = field(default_factory=dict)  # key -> row, when read (auth)
    revoked_keys: set[str] = field(default_factory=set)  # digests revoked by this process (auth)
    open_streams: dict[int, int] = field(default_factory=dict)  # key id -> its live streams (routes/jobs)
    failed_sign_ins: dict[str, tuple[float, int]] = field(default_factory=dict)  # source -> (written, since)
    sso: SingleSignOn = field(init=False)  # single sign-on, if the settings ask for it (server/sso.py)
    # set at start (lifespan)
    engine: Engine = field(init=False)
    devices: list[DeviceInfo] = field(init=False)
    worker_secret: bytes = field(init=False)  # replicas' keys derive from it (scheduler/worker_keys.py)
    scheduler: Scheduler | None = None  # None until started
    notifier: Notifier = field(init=False)  # sends the notifications' outbox (started with the scheduler)
    traffic: Traffic = field(init=False)  # requests forwarded to replicas, not yet answered
    http: httpx.AsyncClient = field(init=False)  # the forwarder's connections to replicas
    replica_readings: dict[tuple[str, int], Any] = field(default_factory=dict)  # counters at the last look


def services(request: Request) -> Services:
    """The services of the app that serves `request`."""
    return request.app.state.services


def services_of(app: FastAPI) -> Services:
    return app.state.services
