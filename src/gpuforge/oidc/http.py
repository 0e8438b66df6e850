"""HTTP to an OpenID provider, bounded: a timeout on every call, a cap on what an answer may hold, no
redirects followed, and https only (plain http for a loopback address alone, as a test's or a laptop's
provider). The provider is named by the admin, but its answers still cross a network."""

from __future__ import annotations

import json
from functools import cache
from http.cookiejar import DefaultCookiePolicy
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpuforge.access import is_loopback
from gpuforge.errors import GpuforgeError

TIMEOUT = httpx.Timeout(10.0, connect=5.0)
MAX_ANSWER_BYTES = 256 * 1024  # a discovery document, a key set or a token answer is a few KiB


class ProviderError(GpuforgeError):
    """The OpenID provider could not be reached, or answered what gpuforge cannot use."""


def check_url(url: str, what: str) -> str:
    """`url` if it is https, or http to a loopback address; a ProviderError naming `what` if not."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and parts.hostname and is_loopback(parts.hostname):
        return url
    raise ProviderError(f"{what} {url!r}: must be an https URL (plain http only to a loopback address)")


def get_json(url: str, what: str) -> dict[str, Any]:
    """The JSON object at `url` (a discovery document, a key set)."""
    status, body = _send("GET", url, what)
    if status != 200:
        raise ProviderError(f"{what} {url}: answered {status}")
    return body


def post_form(
    url: str, form: dict[str, str], what: str, auth: tuple[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """The status and JSON object a form POST is answered with (a token endpoint answers its errors as
    JSON too: the caller reads `error`). `auth`: HTTP Basic client credentials."""
    return _send("POST", url, what, data=form, auth=auth)


def _send(method: str, url: str, what: str, **request: Any) -> tuple[int, dict[str, Any]]:
    check_url(url, what)
    headers = {"Accept": "application/json"}
    try:
        with _http().stream(method, url, headers=headers, **request) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise ProviderError(f"{what} {url}: answer over {MAX_ANSWER_BYTES} bytes")
    except httpx.HTTPError as err:
        raise ProviderError(f"{what} {url}: unreachable ({type(err).__name__}: {err})") from None
    try:
        parsed = json.loads(body)
    except ValueError:
        raise ProviderError(f"{what} {url}: answered {response.status_code}, not JSON") from None
    if not isinstance(parsed, dict):
        raise ProviderError(f"{what} {url}: answered {response.status_code}, not a JSON object")
    return response.status_code, parsed


@cache
def _http() -> httpx.Client:
    """One client for the process, shared by threads (making one loads the CA bundle: tens of ms). It
    keeps no cookies: a provider's are no business of gpuforge's."""
    client = httpx.Client(timeout=TIMEOUT, follow_redirects=False)
    client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # no domain may set one
    return client
