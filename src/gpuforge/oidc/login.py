"""`gpuforge login`'s work: sign the CLI in at the server's OpenID provider and keep the tokens.

    sign_in("https://gpu.example.com", show=print)   # -> the StoredLogin it saved

The server tells which provider and client id (GET /auth/oidc/config, server/oidc.py); the CLI then talks
to the provider itself, as a public client: the device-authorization flow where the provider offers it
(it works over SSH, with the browser on another machine), else the authorization-code flow with PKCE and a
loopback redirect (loopback.py). The ID token is verified here too (a wrong provider or client id shows at
login, not at the first request), then kept in a 0600 file (login_file.py).
"""

from __future__ import annotations

import os
import sys
import webbrowser
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.flows import (
    AuthorizationRequest,
    Client,
    Tokens,
    exchange_code,
    poll_device_flow,
    start_device_flow,
)
from gpuforge.oidc.issuer import Discovery, Issuer
from gpuforge.oidc.login_file import StoredLogin, save_login
from gpuforge.oidc.loopback import LoopbackReceiver
from gpuforge.oidc.verify import Claims, IdTokenVerifier

CONFIG_PATH = "/auth/oidc/config"
BROWSER_WAIT_S = 300.0


@dataclass(frozen=True)
class ServerSso:
    """What a server says of its single sign-on (GET /auth/oidc/config)."""

    issuer: str
    client_id: str  # the CLI's (public) client id
    scopes: tuple[str, ...]
    device_flow: bool


def server_sso(server: str, timeout_s: float = 15.0) -> ServerSso:
    url = server.rstrip("/") + CONFIG_PATH
    try:
        response = httpx.get(url, timeout=timeout_s, follow_redirects=False)
    except httpx.HTTPError as err:
        raise GpuforgeError(f"{server}: server unreachable ({type(err).__name__}: {err})") from None
    if response.status_code == 404:
        raise GpuforgeError(f"{server}: this server has no single sign-on (it signs in with API keys)")
    try:
        body = response.json()
        return ServerSso(
            str(body["issuer"]), str(body["client_id"]), tuple(map(str, body.get("scopes") or ())),
            bool(body.get("device_flow")),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError):
        raise GpuforgeError(
            f"{url}: answered {response.status_code}, not a single sign-on configuration"
        ) from None


def sign_in(
    server: str,
    show: Callable[[str], None],
    use_browser: bool = False,
    open_browser: bool = True,
    directory: Path | None = None,
    sleep: Callable[[float], None] | None = None,
    browser_wait_s: float = BROWSER_WAIT_S,
) -> StoredLogin:
    """Sign in to `server` and keep the tokens; `show` prints what the user must see or do. The device
    flow where the provider offers it and `use_browser` is not set, else the loopback redirect."""
    sso = server_sso(server)
    issuer = Issuer(sso.issuer)
    discovery = issuer.discovery()
    client = Client(sso.client_id)
    scopes = cli_scopes(sso.scopes, discovery)
    if discovery.device_flow and not use_browser:
        tokens, nonce = _device_flow(discovery, client, scopes, show, sleep), None
    else:
        tokens, nonce = _loopback_flow(discovery, client, scopes, show, open_browser, browser_wait_s)
    claims = IdTokenVerifier(issuer, (client.client_id,)).verify_id_token(tokens.id_token, nonce=nonce)
    login = StoredLogin(server, sso.issuer, client.client_id, tokens.id_token, tokens.refresh_token,
                        claims.expires_at)  # fmt: skip
    save_login(login, directory)
    show(f"signed in to {server} as {_who(claims)}")
    return login


def cli_scopes(server_scopes: tuple[str, ...], discovery: Discovery) -> tuple[str, ...]:
    """The server's scopes (openid first), and offline_access where the provider knows it: with some
    providers a refresh token comes only with it."""
    scopes = ["openid", *(s for s in server_scopes if s != "openid")]
    if "offline_access" in discovery.scopes_supported and "offline_access" not in scopes:
        scopes.append("offline_access")
    return tuple(scopes)


def _device_flow(discovery, client, scopes, show, sleep) -> Tokens:
    device = start_device_flow(discovery, client, scopes)
    shown = printable(device.verification_uri), printable(device.user_code)
    show(f"To sign in, open {shown[0]} and enter the code {shown[1]}")
    if device.verification_uri_complete:
        show(f"(or open {printable(device.verification_uri_complete)})")
    return poll_device_flow(discovery, client, device, **({"sleep": sleep} if sleep else {}))


def _loopback_flow(discovery, client, scopes, show, open_browser, wait_s) -> tuple[Tokens, str]:
    with LoopbackReceiver() as receiver:
        request = AuthorizationRequest.new(receiver.redirect_uri)
        url = request.url(discovery, client, scopes)
        show(f"To sign in, open this URL in a browser on this machine:\n{url}")
        if open_browser and can_open_browser():
            try:
                webbrowser.get().open(url)
            except webbrowser.Error:
                pass  # no browser here: the URL is printed
        code = receiver.wait(request.state, wait_s)
    return exchange_code(discovery, client, request, code), request.nonce


def can_open_browser() -> bool:
    """Whether a browser window can open here: not on a Linux machine without a display, where Python's
    webbrowser would start a text browser (lynx, w3m) in the very terminal that shows the URL."""
    if sys.platform.startswith("linux"):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def printable(text: str) -> str:
    """A provider's text as the terminal may show it: no escape sequences or other control characters."""
    return "".join(c for c in text if c.isprintable())


def _who(claims: Claims) -> str:
    return printable(claims.email or claims.name or claims.subject)
