"""The forwarder: a deployment's requests, sent on to its replicas.

    POST /api/v1/deployments/{name}/predict   forwarded to the least loaded ready replica

The body goes as it is, with the deployment's own key (replicas listen on loopback and want it). A
request that finds no ready replica (scaled to zero, or starting) is held, not refused, for HOLD_S at
most while the scheduling loop starts one: the autoscaler sees it waiting (scheduler/traffic.py). A
replica that could not be reached (drained or dead that moment) is left for another: a prediction is
answered once, whichever replica answers it. Any key may send predictions to a deployment.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Annotated

import httpx
from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi import Path as PathParam

from gpuforge.scheduler.worker_keys import replicas_key
from gpuforge.server.auth import Key
from gpuforge.server.permissions import permit
from gpuforge.server.services import services
from gpuforge.store.db import session
from gpuforge.store.deployments import named
from gpuforge.store.models import ENDED_DEPLOYMENT_STATES, DeploymentState

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])
Name = Annotated[str, PathParam(max_length=100, description="the deployment's name")]
FORWARDED_HEADERS = ("content-type", "retry-after")
HOLD_S = 60.0  # a cold start (a replica loading its model) fits in it
POLL_S = 0.1
MAX_HELD = 256  # requests held at once for one deployment; past it 503 (each polls the store)
TRIES = 3  # replicas tried when one cannot be reached
_turns = itertools.count()  # breaks ties between equally loaded replicas: round-robin


@router.post("/{name}/predict", response_model=dict, dependencies=[permit("deployments.predict")])
async def predict(name: Name, request: Request, key: Key) -> Response:
    """Forwarded as it is to the least loaded ready replica (body: as `gpuforge serve` takes it)."""
    body, traffic, began = await request.body(), services(request).traffic, time.monotonic()
    unreachable: set[tuple[int, int]] = set()  # (index, port): a replica started again has a new port
    held = False
    for _ in range(TRIES):
        worker, key_of_replicas, waited = await _ready_replica(request, name, unreachable)
        held, slot = held or waited, worker["index"]
        traffic.begin(name, slot)
        try:
            answer = await services(request).http.post(
                f"http://127.0.0.1:{worker['port']}/predict",
                content=body,
                # JSON whatever the client said (`curl -d` says a form): the replica reads JSON alone
                headers={"content-type": "application/json", "authorization": f"Bearer {key_of_replicas}"},
            )
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            unreachable.add((slot, worker["port"]))  # closing or gone: the request never reached its model
            continue
        except httpx.HTTPError as err:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"replica {slot}: {type(err).__name__}") from err
        finally:
            traffic.end(name, slot)
        headers = {k: v for k, v in answer.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["x-gpuforge-replica"] = str(slot)
        headers["x-gpuforge-version"] = str(worker.get("version", 1))
        if held:
            headers["x-gpuforge-held-ms"] = f"{(time.monotonic() - began) * 1000:.0f}"
        return Response(answer.content, answer.status_code, headers=headers)
    raise HTTPException(
        status.HTTP_502_BAD_GATEWAY, f"deployment {name!r}: {TRIES} replicas could not be reached"
    )


async def _ready_replica(
    request: Request, name: str, unreachable: set[tuple[int, int]]
) -> tuple[dict, str, bool]:
    """The least loaded ready replica not found unreachable, its key, and whether the request was held
    for one (while it is, it counts as waiting in the deployment's traffic: the autoscaler sees it)."""
    traffic, deadline, held = services(request).traffic, time.monotonic() + HOLD_S, False
    try:
        while True:
            ready, key_of_replicas = _replicas(request, name, unreachable)
            if ready:
                turn = next(_turns)
                pick = min(
                    enumerate(ready),
                    key=lambda p: (traffic.load(name, p[1]["index"]), (p[0] - turn) % len(ready)),
                )[1]
                return pick, key_of_replicas, held
            if not held:
                if traffic.of(name).held >= MAX_HELD:
                    raise HTTPException(
                        status.HTTP_503_SERVICE_UNAVAILABLE,
                        f"deployment {name!r} has no ready replica and {MAX_HELD} requests wait already",
                        headers={"Retry-After": "5"},
                    )
                traffic.hold(name)
                services(request).scheduler.wake()
                held = True
            if time.monotonic() > deadline:
                raise HTTPException(
                    status.HTTP_503_SERVICE_UNAVAILABLE,
                    f"deployment {name!r} has no ready replica after {HOLD_S:.0f} s",
                    headers={"Retry-After": "5"},
                )
            await asyncio.sleep(POLL_S)
    finally:
        if held:
            traffic.hold(name, -1)


def _replicas(request: Request, name: str, unreachable: set[tuple[int, int]]) -> tuple[list[dict], str]:
    """The deployment's ready replicas (less those found unreachable) and their key; 404 for a deployment
    that does not serve, 503 for one that is stopping or failing."""
    with session(services(request).engine) as s:
        deployment = named(s, name)
        if deployment is None or deployment.state in ENDED_DEPLOYMENT_STATES:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no deployment {name!r} serving")
        if deployment.state in (DeploymentState.STOPPING, DeploymentState.FAILING):
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"deployment {name!r} is {deployment.state}"
            )
        workers = [w for w in deployment.workers or [] if w.get("ready") and w.get("port")]
        ready = [w for w in workers if (w["index"], w["port"]) not in unreachable]
        return ready, replicas_key(services(request).worker_secret, deployment)
