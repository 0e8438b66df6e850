"""Who may reach a gpuforge process: the key a request presents, and whether an address is loopback.
Shared by the server (server/auth.py, settings.py) and the endpoint worker (serve/worker.py,
cli/serve.py); nothing heavy imported, so a worker does not pull in the store."""

from __future__ import annotations

import ipaddress

LOOPBACK = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # always open: probes carry no key
# the schema, its pages and Prometheus' text: with a key, unless opened (GPUFORGE_PUBLIC_METRICS=true)
DOCUMENT_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
# the dashboard's pages (dashboard/pages.py): the same data-free shell, which asks for the key itself
PAGE_PATHS = frozenset({"/", "/compare", "/devices", "/deployments", "/costs", "/searches", "/audit"})


def is_page_path(path: str) -> bool:
    """A page of the dashboard, or one of its static files: open, since none of them holds data."""
    if path in PAGE_PATHS or path.startswith("/static/"):
        return True
    head, _, item_id = path.rpartition("/")
    return head in ("/jobs", "/searches") and item_id.isdigit() and len(item_id) <= 10


def is_loopback(host: str) -> bool:
    """An address, or `localhost`, that only this machine reaches (not a name that merely starts with
    127., which DNS may send anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """`Authorization: Bearer <key>`, else `X-API-Key: <key>`."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return x_api_key


def carries_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a request (its ASGI headers) has a body on its way: a refusal then closes the connection,
    so that the rest of the body is never read."""
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"") not in (b"", b"0")
