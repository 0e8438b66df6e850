"""The HTTP client behind `gpuforge submit | jobs | job | cancel | resume | logs | keys | projects`, `gpuforge
notifications` and `gpuforge audit`: GPUFORGE_URL (or --url) and GPUFORGE_API_KEY (or the key cli/server.py
read from --api-key-file), else the ID token of a `gpuforge login` to that server (oidc/session.py refreshes
it), errors as one line.

`submit` sends the local files a spec names (data.train, data.eval, a `python:` model's .py file) to the
server first, each once by content (the server answers whether it has a SHA-256 already), and submits
the spec with the server's paths in their place, so a client on another machine works, and the names
it knows them by (`files`), so that the job's errors say `reviews.csv`, not the server's copy. A file it
should send that does not exist here is an error here, before anything is sent. Each submit carries an
Idempotency-Key of its own and is sent again (with that key) after a lost connection, a timeout or a
502/503/504: the server queues one job however many times it arrives (routes/jobs.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpuforge.errors import GpuforgeError
from gpuforge.settings import current
from gpuforge.spec import JobSpec, ScriptJobSpec, SearchSpec, apply_override, working_copy_files

RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # a server restarting takes seconds: 15 s of tries in all
TRANSIENT_STATUS = (502, 503, 504)  # a proxy or the server saying "not now"; the same request may pass
log = logging.getLogger("gpuforge.client")


class Client:
    def __init__(self, url: str | None = None, key: str | None = None, timeout: float = 30.0):
        environment = current()
        self.url = (url or environment.url).rstrip("/")
        key = key or environment.api_key
        signed_in = None if key else _signed_in(self.url)
        if not key and signed_in is None:
            raise GpuforgeError(
                "no API key: set GPUFORGE_API_KEY or pass --api-key-file PATH (the server wrote admin.key), "
                f"or sign in: gpuforge login --server {self.url}"
            )
        headers = {"Authorization": f"Bearer {key}"} if key else {}  # else the sign-in's ID token, kept fresh
        self.http = httpx.Client(base_url=self.url, headers=headers, auth=signed_in, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err
        _raise_for(response)
        return response.json()

    def _retried(self, send: Callable[[], httpx.Response]) -> httpx.Response:
        """send(), and again after a lost connection, a timeout or a 502/503/504, waiting longer each
        time; only for a request the server may receive twice (a content-addressed upload, a submit
        with its idempotency key)."""
        for delay in (*RETRY_DELAYS_S, None):
            try:
                response = send()
                if response.status_code not in TRANSIENT_STATUS or delay is None:
                    return response
                why = f"answered {response.status_code}"
            except httpx.TransportError as err:
                if delay is None:
                    raise _unreachable(self.url, err) from err
                why = f"unreachable ({type(err).__name__})"
            log.warning("%s: server %s; trying again in %g s", self.url, why, delay)
            time.sleep(delay)
        raise AssertionError("unreachable: the last try returns or raises")

    # --- jobs ---
    def submit(
        self,
        spec: JobSpec,
        priority: int | None = None,
        name: str | None = None,
        as_written: dict[str, Any] | None = None,
    ) -> dict:
        """Queue `spec` (its local files sent first), once however often it has to be sent.
        `as_written`: the spec as its file says, before paths were resolved, to name a missing file."""
        if spec.kind == "script":
            body = {**self.script_body(spec), "priority": priority, "name": name}
        else:
            check_local_files(spec, as_written)
            sent, files = self.with_uploads(spec)
            # only what the user wrote (and the uploads' paths): the server fills in the rest, its prices too
            written = sent.to_yaml(exclude_unset=True)
            body = {"spec": written, "priority": priority, "name": name, "files": files or None}
        headers = {"Idempotency-Key": str(uuid.uuid4())}  # one per job asked for: every try sends it
        response = self._retried(lambda: self.http.post("/api/v1/jobs", json=body, headers=headers))
        _raise_for(response)
        return response.json()

    def search(self, search: SearchSpec, name: str | None = None, priority: int | None = None) -> dict:
        """Start a search on the server (the job's local files sent first, as a submit sends them)."""
        check_local_files(search.job, None)
        sent, files = self.with_uploads(search.job)
        tune = yaml.safe_dump(search.tune.model_dump(mode="json", by_alias=True), sort_keys=False)
        body = {"spec": sent.to_yaml(exclude_unset=True), "tune": tune, "name": name, "priority": priority,
                "files": files or None}  # fmt: skip
        return self._call("POST", "/api/v1/searches", json=body)

    def searches(self) -> list[dict]:
        return self._call("GET", "/api/v1/searches")

    def search_view(self, search_id: int) -> dict:
        return self._call("GET", f"/api/v1/searches/{search_id}")

    def stop_search(self, search_id: int) -> dict:
        return self._call("POST", f"/api/v1/searches/{search_id}/stop")

    def jobs(self, state: str | None = None) -> list[dict]:
        return self._call("GET", "/api/v1/jobs", params={"state": state} if state else None)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}")

    def slurm_script(self, job_id: int) -> str:
        """The batch script the job's last attempt submitted to Slurm."""
        try:
            response = self.http.get(f"/api/v1/jobs/{job_id}/slurm-script")
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err
        _raise_for(response)
        return response.text

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/api/v1/jobs/{job_id}/cancel")

    def resume(self, job_id: int, budget_usd: float | None = None, no_budget: bool = False) -> dict:
        """Queue a paused or cancelled job again; its budget kept unless `budget_usd` (or `no_budget`)."""
        body = {"budget_usd": None} if no_budget else {} if budget_usd is None else {"budget_usd": budget_usd}
        return self._call("POST", f"/api/v1/jobs/{job_id}/resume", json=body)

    def events(self, job_id: int, after: int = -1) -> list[dict]:
        return self._call("GET", f"/api/v1/jobs/{job_id}/events", params={"after": after})

    def metrics(self, job_id: int, after_step: int = -1, limit: int = 1000) -> list[dict]:
        params = {"after_step": after_step, "limit": limit}
        return self._call("GET", f"/api/v1/jobs/{job_id}/metrics", params=params)

    def summary(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}/summary")

    def ask_profile(self, job_id: int, steps: int) -> dict:
        return self._call("POST", f"/api/v1/jobs/{job_id}/profile", json={"steps": steps})

    def profile(self, job_id: int) -> dict:
        return self._call("GET", f"/api/v1/jobs/{job_id}/profile")

    def profile_trace(self, job_id: int, target: Path, rank: int = 0) -> None:
        """Save a rank's trace (gzipped JSON) to `target`, whole or not at all."""
        partial = target.with_name(target.name + ".partial")
        try:
            with self.http.stream(
                "GET", f"/api/v1/jobs/{job_id}/profile/trace", params={"rank": rank}
            ) as got:
                if got.status_code >= 400:
                    got.read()
                    _raise_for(got)
                with partial.open("wb") as f:
                    for chunk in got.iter_bytes():
                        f.write(chunk)
            partial.replace(target)
        except httpx.HTTPError as err:
            raise _unreachable(self.url, err) from err
        except OSError as err:
            raise GpuforgeError(f"--trace {target}: cannot be written ({err.strerror})") from None
        finally:
            partial.unlink(missing_ok=True)  # a failed fetch leaves nothing behind

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
    def deploy(self, job_id: int, name: str, options: dict | None = None, **fields: Any) -> dict:
        """A new deployment, or on a live name its next version. `fields`: model (a variant, e.g.
        compressed/onnx-int8), replicas, devices (a replica's: a fraction of one device), min_replicas,
        max_replicas, target_queue, scale_down_after_s, max_metric_drop (None: the server's default)."""
        body = {"job_id": job_id, "name": name, **{k: v for k, v in fields.items() if v is not None}}
        if options:
            body["options"] = options
        return self._call("POST", "/api/v1/deployments", json=body)

    def deployment_versions(self, name: str) -> list[dict]:
        return self._call("GET", f"/api/v1/deployments/{name}/versions")

    def deployment_events(self, name: str) -> list[dict]:
        return self._call("GET", f"/api/v1/deployments/{name}/events")

    def rollback(self, name: str, to: int | None = None) -> dict:
        return self._call("POST", f"/api/v1/deployments/{name}/rollback", json={"to": to})

    def add_adapter(self, name: str, job_id: int, adapter: str | None = None) -> dict:
        body = {"job_id": job_id, **({"name": adapter} if adapter else {})}
        return self._call("POST", f"/api/v1/deployments/{name}/adapters", json=body)

    def remove_adapter(self, name: str, adapter: str) -> dict:
        return self._call("DELETE", f"/api/v1/deployments/{name}/adapters/{adapter}")

    def deployments(self, every: bool = False) -> list[dict]:
        """The live deployments; every=True: the stopped and failed too."""
        return self._call("GET", "/api/v1/deployments", params={"all": every})

    def deployment(self, name: str) -> dict:
        return self._call("GET", f"/api/v1/deployments/{name}")

    def undeploy(self, name: str) -> dict:
        return self._call("DELETE", f"/api/v1/deployments/{name}")

    def predict(self, name: str, inputs: list, adapter: str | None = None) -> dict:
        body = {"inputs": inputs, **({"adapter": adapter} if adapter else {})}
        return self._call("POST", f"/api/v1/deployments/{name}/predict", json=body)

    # --- keys ---
    def create_key(
        self,
        name: str,
        admin: bool = False,
        quotas: dict[str, int] | None = None,
        project: str | None = None,
        role: str | None = None,
    ) -> dict:
        body = {"name": name, "admin": admin, **(quotas or {}), **({"project": project} if project else {})}
        return self._call("POST", "/api/v1/keys", json={**body, **({"role": role} if role else {})})

    def set_key(self, name: str, quotas: dict[str, int | str | None]) -> dict:
        """Change a key's quotas (those given; None puts one back to the default) or its "project" (None:
        none)."""
        return self._call("PATCH", f"/api/v1/keys/{name}", json=quotas)

    def keys(self) -> list[dict]:
        return self._call("GET", "/api/v1/keys")

    def revoke_key(self, name: str) -> dict:
        return self._call("DELETE", f"/api/v1/keys/{name}")

    # --- projects ---
    def create_project(self, name: str, settings: dict[str, float | int | None]) -> dict:
        return self._call("POST", "/api/v1/projects", json={"name": name, **settings})

    def projects(self) -> list[dict]:
        return self._call("GET", "/api/v1/projects")

    def set_project(self, name: str, settings: dict[str, float | int | None]) -> dict:
        """Change a project's settings: those given; None: no budget, no device cap."""
        return self._call("PATCH", f"/api/v1/projects/{name}", json=settings)

    def set_member(self, project: str, key: str, role: str) -> dict:
        """Put `key` in `project` with `role`, or change its role there (a maintainer, or an admin)."""
        return self._call("PUT", f"/api/v1/projects/{project}/members/{key}", json={"role": role})

    def remove_member(self, project: str, key: str) -> dict:
        return self._call("DELETE", f"/api/v1/projects/{project}/members/{key}")

    # --- audit ---
    def audit(self, **filters: str | int | None) -> list[dict]:
        """The audit log, newest first: project, actor, action, since (ISO 8601), before (an id), limit."""
        return self._call("GET", "/api/v1/audit", params={k: v for k, v in filters.items() if v is not None})

    # --- notifications ---
    def add_notification_target(
        self, url: str, format: str = "json", project: str | None = None, events: list[str] | None = None
    ) -> dict:
        """A new target: its answer holds its signing secret, shown this once."""
        body = {"url": url, "format": format, "project": project, "events": events}
        return self._call("POST", "/api/v1/notifications/targets", json={k: v for k, v in body.items() if v})

    def notification_targets(self) -> list[dict]:
        return self._call("GET", "/api/v1/notifications/targets")

    def remove_notification_target(self, target_id: int) -> dict:
        return self._call("DELETE", f"/api/v1/notifications/targets/{target_id}")

    def test_notification_target(self, target_id: int) -> dict:
        """Send a test event now: the delivery as that try left it."""
        return self._call("POST", f"/api/v1/notifications/targets/{target_id}/test")

    def notification_deliveries(self, state: str | None = None, limit: int = 100) -> list[dict]:
        params = {"limit": limit, **({"state": state} if state else {})}
        return self._call("GET", "/api/v1/notifications/deliveries", params=params)

    # --- costs ---
    def costs(self, by: str = "day", since: str | None = None, project: str | None = None) -> dict:
        """Spend from the server's cost ledger, summed by day, key or project."""
        params = {"by": by, "since": since, "project": project}
        return self._call("GET", "/api/v1/costs", params={k: v for k, v in params.items() if v is not None})

    def prices(self) -> dict:
        """The server's prices: each device's, and (for an admin key) its prices.yaml's entries."""
        return self._call("GET", "/api/v1/prices")

    # --- uploads ---
    def upload(self, path: Path) -> str:
        """The server's path for this file's content, sending it only if the server lacks it."""
        sha = file_sha256(path)
        params = {"name": path.name}

        def put() -> httpx.Response:
            with path.open("rb") as f:  # opened again for each try
                return self.http.put(f"/api/v1/uploads/{sha}", params=params, content=f)

        response = self._retried(lambda: self.http.get(f"/api/v1/uploads/{sha}", params=params))
        if response.status_code == 404:
            response = self._retried(put)
        _raise_for(response)
        return response.json()["path"]

    def script_body(self, spec: ScriptJobSpec) -> dict[str, Any]:
        """A script job's spec and its working copy: each file `script.files` names, sent once by content,
        by its path inside the folder. The server makes the copy (workdir left empty: its own)."""
        workdir = Path(spec.script.workdir)
        sent = {rel: self.upload(workdir / rel) for rel in working_copy_files(spec.script, workdir)}
        spec = spec.model_copy(deep=True)
        spec.script.workdir = ""
        return {"spec": spec.to_yaml(exclude_unset=True), "script_files": sent}

    def with_uploads(self, spec: JobSpec) -> tuple[JobSpec, dict[str, str]]:
        """`spec` with each local file it names replaced by the server's copy, and {server path: local
        path} of those files."""
        raw = spec.model_dump(mode="json", exclude_unset=True)  # what the user wrote: the rest stays unset
        files = {}
        for _field, local in local_files(spec):
            if local.is_file():  # else a server's own file, written absolute (check_local_files)
                files[self.upload(local)] = str(local)
        server_path = {local: server for server, local in files.items()}
        for field in ("train", "eval"):
            if raw["data"].get(field) in server_path:
                raw["data"][field] = server_path[raw["data"][field]]
        scheme, _, rest = raw["model"]["source"].partition(":")
        module, _, fn = rest.rpartition(":")
        if scheme == "python" and module in server_path:
            raw["model"]["source"] = f"python:{server_path[module]}:{fn}"
        return JobSpec.model_validate(raw), files


def _signed_in(url: str) -> httpx.Auth | None:
    """The bearer auth of a `gpuforge login` kept for `url`, if there is one."""
    from gpuforge.oidc.login_file import load_login
    from gpuforge.oidc.session import SignedIn

    login = load_login(url)
    return SignedIn(login) if login else None


def local_files(spec: JobSpec) -> list[tuple[str, Path]]:
    """The files `submit` sends, by the field that names them: data.train, data.eval, a `python:`
    model's .py file (an `hf:` model directory is the server's own: never sent)."""
    return [
        (field, path)
        for field, path in spec.file_references()
        if field in ("data.train", "data.eval") or str(path).endswith(".py")
    ]


def spec_as_written(path: Path, overrides: list[str]) -> dict[str, Any]:
    """The spec file's YAML with the --set overrides, its paths as the user wrote them (call it after
    load_spec accepted the file)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    for assignment in overrides:
        apply_override(raw, assignment)
    return raw


def check_local_files(spec: JobSpec, as_written: dict[str, Any] | None = None) -> None:
    """A GpuforgeError naming the field and the path as written when a file `submit` would send is not
    here (what `gpuforge train` says of the same spec), before anything is sent. A path written absolute
    that is not here names a file on the server (under its data roots): the server checks that one."""
    for field, path in local_files(spec):
        if not path.is_file():
            section, _, key = field.partition(".")
            written = ((as_written or {}).get(section) or {}).get(key)
            if field == "model.source" and isinstance(written, str):
                written = written.partition(":")[2].rpartition(":")[0]  # python:<module>:<fn>
            if isinstance(written, str) and Path(written).is_absolute() and not path.exists():
                continue
            shown = written if isinstance(written, str) and written else path
            what = "is a directory, expected a file" if path.is_dir() else "no such file"
            raise GpuforgeError(f"{field}: {shown}: {what}")


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
    if isinstance(detail, list):  # the API's request validation: pydantic's list of {loc, msg, ...}
        detail = validation_text(detail)
    raise GpuforgeError(f"server answered {response.status_code}: {detail}")


REQUEST_PARTS = ("body", "query", "path", "header")  # where pydantic found it: not the field's name


def validation_text(errors: list) -> str:
    """The API's 422 list as one line, a field and its rule an error: `name: 'Topics v1' must match
    ^[a-z0-9-]+$; replicas: must be greater than or equal to 1 (not 0)`."""
    lines = []
    for error in errors:
        if not isinstance(error, dict):
            lines.append(str(error))
            continue
        loc = [str(part) for part in error.get("loc") or []]
        field = ".".join(loc[1:] if loc and loc[0] in REQUEST_PARTS else loc)
        lines.append(f"{field}: {_rule(error)}" if field else _rule(error))
    return "; ".join(lines)


def _rule(error: dict) -> str:
    """What one validation error asks for, with the value refused where it is short enough to read."""
    given, context = error.get("input"), error.get("ctx") or {}
    if error.get("type") == "string_pattern_mismatch" and "pattern" in context:
        return f"{given!r} must match {context['pattern']}"
    rule = str(error.get("msg", "not accepted")).removeprefix("Value error, ")
    rule = rule[:1].lower() + rule[1:]  # "Input should be ..." reads on after "field: "
    shown = repr(given)
    if error.get("type") != "missing" and not isinstance(given, dict | list) and len(shown) <= 60:
        rule += f" (not {shown})"
    return rule
