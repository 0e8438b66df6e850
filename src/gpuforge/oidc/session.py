"""The client's side of a `gpuforge login`: each request to the server carries the kept ID token as
`Authorization: Bearer <id_token>`, refreshed first when it expires within REFRESH_BEFORE_S.

    http = httpx.Client(base_url=url, auth=SignedIn(load_login(url)))
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Generator
from pathlib import Path

import httpx

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.flows import Client, refresh
from gpuforge.oidc.issuer import Issuer
from gpuforge.oidc.login_file import StoredLogin, save_login
from gpuforge.oidc.verify import IdTokenVerifier

REFRESH_BEFORE_S = 60


class SignedIn(httpx.Auth):
    """An httpx auth that presents a stored sign-in's ID token, refreshing it (and its file) in time."""

    def __init__(self, login: StoredLogin, directory: Path | None = None):
        self.login, self.directory = login, directory
        self._lock = threading.Lock()

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.current_token()}"
        yield request

    def current_token(self) -> str:
        with self._lock:
            if self.login.expires_at - time.time() <= REFRESH_BEFORE_S:
                self.login = refreshed(self.login)
                save_login(self.login, self.directory)
            return self.login.id_token


def refreshed(login: StoredLogin) -> StoredLogin:
    """`login` with a new ID token from its refresh token, verified, for the same user."""
    if not login.refresh_token:
        raise GpuforgeError(
            f"the sign-in to {login.server} has expired: gpuforge login --server {login.server}"
        )
    issuer = Issuer(login.issuer)
    try:
        tokens = refresh(issuer.discovery(), Client(login.client_id), login.refresh_token)
        claims = IdTokenVerifier(issuer, (login.client_id,)).verify_id_token(tokens.id_token)
    except GpuforgeError as err:
        again = f"gpuforge login --server {login.server}"
        raise GpuforgeError(
            f"the sign-in to {login.server} could not be refreshed ({err}): {again}"
        ) from None
    if claims.subject != login_subject(login):
        raise GpuforgeError("a refresh gave an ID token for another user: not used; gpuforge login again")
    return StoredLogin(login.server, login.issuer, login.client_id, tokens.id_token, tokens.refresh_token,
                       claims.expires_at)  # fmt: skip


def login_subject(login: StoredLogin) -> str | None:
    """The `sub` of the kept ID token, read without verifying (it was verified when it was kept)."""
    try:
        payload = login.id_token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("sub")
    except (IndexError, ValueError, AttributeError):
        return None
