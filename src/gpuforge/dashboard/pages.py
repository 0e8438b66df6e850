"""The dashboard's pages on a FastAPI app: one HTML shell for every page path, and the static files it
loads. They hold no data (the pages read /api/v1 with the tab's key), so they answer without a key
(access.is_page_path); every answer carries a Content-Security-Policy that lets a page load and talk to
this server alone."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from gpuforge.access import PAGE_PATHS

STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    # no inline script or style, nothing from another origin, never framed (clickjacking)
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class _StaticFiles(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def add_pages(app: FastAPI) -> None:
    """Serve the shell at every page path and the files under /static/."""
    app.mount("/static", _StaticFiles(directory=STATIC, check_dir=False), name="static")

    def shell() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    for path in sorted(PAGE_PATHS):
        app.add_api_route(path, shell, methods=["GET"], include_in_schema=False)
    app.add_api_route("/jobs/{job_id:int}", shell, methods=["GET"], include_in_schema=False)
    app.add_api_route("/searches/{search_id:int}", shell, methods=["GET"], include_in_schema=False)
