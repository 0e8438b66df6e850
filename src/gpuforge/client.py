"""The HTTP client behind `gpuforge submit | jobs | job | cancel`: GPUFORGE_URL and GPUFORGE_API_KEY
(or --url / --key), one call a verb, errors as one line."""

from __future__ import annotations

import os
from typing import Any

import httpx

from gpuforge.errors import GpuforgeError

DEFAULT_URL = "http://127.0.0.1:8600"


class Client:
    def __init__(self, url: str | None = None, key: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("GPUFORGE_URL") or DEFAULT_URL).rstrip("/")
        key = key or os.environ.get("GPUFORGE_API_KEY")
        if not key:
            raise GpuforgeError("no API key: set GPUFORGE_API_KEY or pass --key (the server wrote admin.key)")
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise GpuforgeError(f"{self.url}: server unreachable ({type(err).__name__}: {err})") from err
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text[:500]
            raise GpuforgeError(f"server answered {response.status_code}: {detail}")
        return response.json()

    def submit(self, spec_yaml: str, priority: int | None = None, name: str | None = None) -> dict:
        return self._call(
            "POST", "/api/v1/jobs", json={"spec": spec_yaml, "priority": priority, "name": name}
        )

    def jobs(self, state: str | None = None) -> list[dict]:
        return self._call("GET", "/api/v1/jobs", params={"state": state} if state else None)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}")

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/api/v1/jobs/{job_id}/cancel")
