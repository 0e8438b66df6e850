"""The HTTP client behind `gpuforge submit | jobs | job | cancel | resume | logs | keys`:
GPUFORGE_URL (or --url) and GPUFORGE_API_KEY (or the key cli_server.py read from --api-key-file), errors
as one line.

`submit` sends the local files a spec names (data.train, data.eval, a `python:` model's .py file) to the
server first, each once by content (the server answers whether it has a SHA-256 already), and submits
the spec with the server's paths in their place, so a client on another machine works. A path that does
not exist here is left as it is: it names a file on the server, under its data roots.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gpuforge.errors import GpuforgeError
from gpuforge.spec import DATA_SCHEMES, JobSpec

DEFAULT_URL = "http://127.0.0.1:8600"


class Client:
    def __init__(self, url: str | None = None, key: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("GPUFORGE_URL") or DEFAULT_URL).rstrip("/")
        key = key or os.environ.get("GPUFORGE_API_KEY")
        if not key:
            raise GpuforgeError(
                "no API key: set GPUFORGE_API_KEY or pass --api-key-file PATH (the server wrote admin.key)"
            )
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err
        _raise_for(response)
        return response.json()

    # --- jobs ---
    def submit(self, spec: JobSpec, priority: int | None = None, name: str | None = None) -> dict:
        spec_yaml = self.with_uploads(spec).to_yaml()
        return self._call(
            "POST", "/api/v1/jobs", json={"spec": spec_yaml, "priority": priority, "name": name}
        )

    def jobs(self, state: str | None = None) -> list[dict]:
        return self._call("GET", "/api/v1/jobs", params={"state": state} if state else None)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}")

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/api/v1/jobs/{job_id}/cancel")

    def resume(self, job_id: int, budget_usd: float | None) -> dict:
        return self._call("POST", f"/api/v1/jobs/{job_id}/resume", json={"budget_usd": budget_usd})

    def events(self, job_id: int, after: int = -1) -> list[dict]:
        return self._call("GET", f"/api/v1/jobs/{job_id}/events", params={"after": after})

    def metrics(self, job_id: int, after_step: int = -1, limit: int = 1000) -> list[dict]:
        params = {"after_step": after_step, "limit": limit}
        return self._call("GET", f"/api/v1/jobs/{job_id}/metrics", params=params)

    def summary(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}/summary")

    def logs(self, job_id: int, tail: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}/logs", params={"tail": tail})

    def follow(self, job_id: int, offset: int, metrics: bool = True) -> Iterator[tuple[str, dict]]:
        """(event, data) pairs from the job's log stream until it stops: log, metric, then end."""
        params = {"offset": offset, "metrics": metrics}
        no_read_limit = httpx.Timeout(30, read=None)  # a quiet job sends nothing for a while
        try:
            with self.http.stream(
                "GET", f"/api/v1/jobs/{job_id}/logs/stream", params=params, timeout=no_read_limit
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for(response)
                event = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event:
                        yield event, json.loads(line[6:])
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err

    # --- deployments ---
    def deploy(self, job_id: int, name: str, replicas: int = 1, options: dict | None = None) -> dict:
        body = {"job_id": job_id, "name": name, "replicas": replicas, "options": options or {}}
        return self._call("POST", "/api/v1/deployments", json=body)

    def deployments(self) -> list[dict]:
        return self._call("GET", "/api/v1/deployments")

    def deployment(self, name: str) -> dict:
        return self._call("GET", f"/api/v1/deployments/{name}")

    def undeploy(self, name: str) -> dict:
        return self._call("DELETE", f"/api/v1/deployments/{name}")

    def predict(self, name: str, inputs: list, adapter: str | None = None) -> dict:
        body = {"inputs": inputs, **({"adapter": adapter} if adapter else {})}
        return self._call("POST", f"/api/v1/deployments/{name}/predict", json=body)

    # --- keys ---
    def create_key(self, name: str, admin: bool = False, quotas: dict[str, int] | None = None) -> dict:
        return self._call("POST", "/api/v1/keys", json={"name": name, "admin": admin, **(quotas or {})})

    def set_key(self, name: str, quotas: dict[str, int | None]) -> dict:
        """Change a key's quotas: those given; None puts one back to the default."""
        return self._call("PATCH", f"/api/v1/keys/{name}", json=quotas)

    def keys(self) -> list[dict]:
        return self._call("GET", "/api/v1/keys")

    def revoke_key(self, name: str) -> dict:
        return self._call("DELETE", f"/api/v1/keys/{name}")

    # --- uploads ---
    def upload(self, path: Path) -> str:
        """The server's path for this file's content, sending it only if the server lacks it."""
        sha = file_sha256(path)
        params = {"name": path.name}
        response = self.http.get(f"/api/v1/uploads/{sha}", params=params)
        if response.status_code == 404:
            with path.open("rb") as f:
                response = self.http.put(f"/api/v1/uploads/{sha}", params=params, content=f)
        _raise_for(response)
        return response.json()["path"]

    def with_uploads(self, spec: JobSpec) -> JobSpec:
        """`spec` with each local file it names replaced by the server's copy."""
        raw = spec.model_dump(mode="json")
        try:
            for section, field in (("data", "train"), ("data", "eval")):
                value = raw[section].get(field)
                if value and value.partition(":")[0] not in DATA_SCHEMES and Path(value).is_file():
                    raw[section][field] = self.upload(Path(value))
            scheme, _, rest = raw["model"]["source"].partition(":")
            module, _, fn = rest.rpartition(":")
            if scheme == "python" and module.endswith(".py") and Path(module).is_file():
                raw["model"]["source"] = f"python:{self.upload(Path(module))}:{fn}"
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err
        return JobSpec.model_validate(raw)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _unreachable(url: str, err: Exception) -> GpuforgeError:
    return GpuforgeError(f"{url}: server unreachable ({type(err).__name__}: {err})")


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text[:500]
    raise GpuforgeError(f"server answered {response.status_code}: {detail}")
