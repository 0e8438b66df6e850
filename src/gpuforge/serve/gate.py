"""Who may send what, decided before a byte of a body is read: a worker's outermost ASGI middleware.

With a key, every path but the open ones (/healthz, /readyz; /metrics and the API docs too when public)
needs it: `Authorization: Bearer <key>` or `X-API-Key`, 401 otherwise. A body over the limit gets 413, at
once by its Content-Length or as soon as the bytes of a chunked one pass it. Every body it lets through is
read as JSON, whatever its Content-Type says (curl's `-d` says a form).
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from gpuforge.access import carries_body, presented_key


class Gate:
    """Before the app reads a byte of a body: 401 for a request without the key (when there is one) to
    a path not in `open_paths`, then 413 for a body over `max_body_bytes`, at once by its Content-Length,
    or for a body sent in chunks as soon as the bytes received pass the limit. FastAPI reads a body before
    it runs a route's dependencies, so a key checked there comes too late; @app.middleware("http") would
    wrap every request and response in extra tasks. A refusal closes the connection when a body was on its
    way, so the rest of it is never read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, open_paths: frozenset[str]):
        self.app, self.limit, self.open_paths = app, max_body_bytes, open_paths
        self.key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names lower-case (ASGI)
        length = headers.get(b"content-length", b"")
        has_body = carries_body(headers)
        if self.key is not None and scope["path"] not in self.open_paths and not self._has_key(headers):
            return await _refuse(scope, send, 401, "missing or wrong API key", has_body,
                                 {"WWW-Authenticate": "Bearer"})  # fmt: skip
        if length.isdigit() and int(length) > self.limit:
            return await _refuse(scope, send, 413, self._too_large(int(length)), has_body)
        if has_body and not _says_json(headers.get(b"content-type", b"")):
            scope = _read_as_json(scope)
        received, started, refused = 0, False, False

        async def counted():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # the route reads no further: to it, the client has gone
                refused = True
                if not started:
                    await _refuse(scope, send, 413, self._too_large(received), True)
                return {"type": "http.disconnect"}
            return message

        async def answering(message):
            nonlocal started
            if refused:
                return  # the 413 is sent; what the route answers to the "disconnect" goes nowhere
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, answering)

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        authorization, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        given = presented_key(
            authorization and authorization.decode("latin-1"), x_api_key and x_api_key.decode("latin-1")
        )
        return given is not None and hmac.compare_digest(given.encode("latin-1"), self.key)

    def _too_large(self, size: int) -> str:
        return f"body of {size} bytes or more is over the {self.limit} allowed (--max-body-bytes)"


async def _refuse(scope, send, code: int, message: str, has_body: bool, headers=None) -> None:
    """Answer `code` without reading the body; with one on its way, the connection closes after."""
    headers = {**(headers or {}), **({"Connection": "close"} if has_body else {})}
    if scope["path"].startswith("/v1/"):  # OpenAI clients read the error where they look for it
        from gpuforge.serve.openai_api import error_response

        response = error_response(code, message, headers)
    else:
        response = JSONResponse({"detail": message}, code, headers=headers)
    await response(scope, _no_body, send)


async def _no_body():
    raise RuntimeError("a refused request's body is not read")


def _says_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _read_as_json(scope):
    """The request with `Content-Type: application/json`: every body this worker takes is JSON, and
    `curl -d` (the README's example) says application/x-www-form-urlencoded, which FastAPI would hand the
    route as bytes (422, "Input should be a valid dictionary"). A body that is not JSON stays a 422."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
