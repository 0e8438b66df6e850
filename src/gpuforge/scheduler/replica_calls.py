"""What the scheduling loop asks a replica on loopback, each call short (the loop waits on it): whether it
is ready, the eval metric it measured at load, and the adapters it serves (add one, remove one)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

log = logging.getLogger("gpuforge.scheduler")
READY_TIMEOUT_S = 0.05
CALL_TIMEOUT_S = 2.0  # registering an adapter reads its manifest only: its weights load on first use


def ready(port: int) -> tuple[bool, str | None]:
    """(ready, why it never will be): a replica that answers 503 with another reason than loading failed."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=READY_TIMEOUT_S)
    except httpx.HTTPError:
        return False, None
    if answer.status_code == 200:
        return True, None
    return False, (None if "still loading" in (detail := _detail(answer)) else detail)


def eval_metric(port: int, key: str) -> dict[str, Any] | None:
    """The eval metric the replica measured at load (/info's `eval`), or None: it has no held-out split.
    An OSError-like failure raises httpx.HTTPError: the caller asks again at its next pass."""
    answer = httpx.get(f"http://127.0.0.1:{port}/info", headers=_auth(key), timeout=CALL_TIMEOUT_S)
    answer.raise_for_status()
    return answer.json().get("eval")


def add_adapter(port: int, key: str, name: str, path: str) -> str | None:
    """Register adapter `name` (a LoRA model/ at `path`) on the replica; None once it serves it, else why
    it refused (a refusal is final: the same call would be refused again)."""
    answer = httpx.post(f"http://127.0.0.1:{port}/admin/adapters", json={"name": name, "path": path},
                        headers=_auth(key), timeout=CALL_TIMEOUT_S)  # fmt: skip
    if answer.status_code >= 500:  # not the adapter's fault: asked again at the next pass
        answer.raise_for_status()
    return None if answer.status_code in (200, 201) else f"{answer.status_code}: {_detail(answer)}"


def remove_adapter(port: int, key: str, name: str) -> None:
    """Stop serving adapter `name` (gone already: done too)."""
    answer = httpx.delete(f"http://127.0.0.1:{port}/admin/adapters/{name}", headers=_auth(key),
                          timeout=CALL_TIMEOUT_S)  # fmt: skip
    if answer.status_code not in (200, 404):
        answer.raise_for_status()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _detail(answer: httpx.Response) -> str:
    try:
        return str(answer.json().get("detail"))
    except ValueError:
        return answer.text[:200]
