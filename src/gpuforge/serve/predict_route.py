"""POST /predict answered below FastAPI's per-request layers: the hot route of a classifier's worker.

Measured under load on a 2-core Xeon (32 clients, wrk), the event loop spent ~0.34 ms of CPU per request,
and half of it in the framework between the Gate and the route (exception and exit-stack middleware, the
router, the dependency solver, the body read into a pydantic model), CPU the model thread then lacks on a
machine whose cores it shares. `PredictRoute` sits just inside the Gate (which has checked the key and
bounds the body) and answers POST /predict itself: the body read whole, parsed by the C JSON parser and
validated as `PredictRequest`, then the backend's answer sent. Errors keep the framework's shapes: a body
that is not JSON or not a `PredictRequest` is 422 with `detail` a list of {type, loc, msg, input, ctx}
whose loc starts at "body" (an empty one: "missing" at ["body"]); one that cannot be parsed at all (not
UTF-8, nested past the parser's depth) is 400 "There was an error parsing the body"; an HTTPException is
its status with `detail` and its headers. Every other request
goes on to FastAPI, which also still documents /predict (its route stays registered, never reached).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import Request

from gpuforge.serve.endpoint import Backend, PredictRequest

PATH = "/predict"


class PredictRoute:
    """ASGI middleware: POST /predict to `backend.predict`, anything else to `app`."""

    def __init__(self, app, backend: Backend):
        self.app, self.backend = app, backend

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body = await _body(receive)
        if body is None:
            return  # the client went away (or the Gate refused the body and has answered)
        parsed = _parse(body)
        if isinstance(parsed, JSONResponse):
            return await parsed(scope, receive, send)
        try:
            response = await self.backend.predict(parsed, Request(scope, receive))
        except HTTPException as err:
            response = JSONResponse({"detail": err.detail}, err.status_code, headers=err.headers)
        await response(scope, receive, send)


async def _body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(body: bytes) -> PredictRequest | JSONResponse:
    """The body as a PredictRequest, or the framework's answer to one it cannot take."""
    if not body:
        missing = {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}
        return JSONResponse({"detail": [missing]}, 422)
    try:
        return PredictRequest.model_validate(json.loads(body))
    except (UnicodeDecodeError, RecursionError):  # before ValueError: UnicodeDecodeError is one
        return JSONResponse({"detail": "There was an error parsing the body"}, 400)
    except ValueError as err:  # not JSON, or not a PredictRequest
        return JSONResponse({"detail": _invalid(err)}, 422)


def _invalid(err: ValueError) -> list[dict[str, Any]]:
    """The framework's 422 detail for a body it could not take."""
    if isinstance(err, ValidationError):
        return jsonable_encoder([{**e, "loc": ["body", *e["loc"]]} for e in err.errors(include_url=False)])
    position, why = (err.pos, err.msg) if isinstance(err, json.JSONDecodeError) else (0, str(err))
    return [{"type": "json_invalid", "loc": ["body", position], "msg": "JSON decode error",
             "input": {}, "ctx": {"error": why}}]  # fmt: skip
