"""An app's routes as a flat list, those of included routers too."""

from __future__ import annotations

from fastapi.routing import APIRoute


def flat_routes(routes) -> list[APIRoute]:
    """Every APIRoute of `routes` (FastAPI 0.165 keeps an included router whole, under `original_router`)."""
    found = []
    for route in routes:
        included = getattr(route, "original_router", None)
        found += flat_routes(included.routes) if included is not None else [route]
    return [route for route in found if isinstance(route, APIRoute)]
