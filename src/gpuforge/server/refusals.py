"""How a route answers a request past one of its key's quotas (store/quotas.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import HTTPException, status

from gpuforge.store.quotas import QuotaExceeded


@contextmanager
def quota_refusal() -> Iterator[None]:
    """A request past one of its key's quotas: 429 for what a key holds at once (it may pass later, or once
    the admin raises it), 422 for what one request may ask (max_priority). The message names the quota."""
    try:
        yield
    except QuotaExceeded as err:
        code = (
            status.HTTP_422_UNPROCESSABLE_CONTENT
            if err.quota.per_request
            else status.HTTP_429_TOO_MANY_REQUESTS
        )
        raise HTTPException(code, str(err)) from err
