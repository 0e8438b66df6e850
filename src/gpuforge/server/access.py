"""Who may reach a gpuforge process: the key a request presents, and whether an address is loopback.
Shared by the server (server/auth.py, settings.py) and the endpoint worker (serve/worker.py,
cli_serve.py); nothing heavy imported, so a worker does not pull in the store."""

from __future__ import annotations

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """`Authorization: Bearer <key>`, else `X-API-Key: <key>`."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return x_api_key
