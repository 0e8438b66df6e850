"""The OAuth 2.0 exchanges gpuforge makes with an OpenID provider, as a client:

- the authorization-code flow with PKCE (RFC 7636, S256): `AuthorizationRequest.new()` makes its state,
  nonce and code verifier, `.url()` is where the browser goes, `exchange_code()` trades the code that comes
  back (with the verifier) for tokens;
- refresh (RFC 6749, 6): `refresh()` trades a refresh token for new tokens;
- the device-authorization flow (RFC 8628), for a terminal with no browser at hand: `start_device_flow()`
  asks for a user code, `poll_device_flow()` waits for the user to approve it.

Each returns `Tokens`, the ID token not yet verified: the caller verifies it (verify.py) with the nonce
it sent, if any. A client secret is sent in the Authorization header (client_secret_basic) or, where the
provider takes only that, in the POST body; never in a URL, never in a message.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from gpuforge.oidc.http import ProviderError, post_form
from gpuforge.oidc.issuer import Discovery

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
SLOW_DOWN_STEP_S = 5  # RFC 8628, 3.5: each slow_down adds 5 s to the polling interval


class SignInFailed(ProviderError):
    """The provider refused a sign-in (a denied request, an expired code, a bad grant)."""


@dataclass(frozen=True)
class Client:
    """How gpuforge is registered at the provider: a client id, and a secret for a confidential client
    (the server's dashboard); the CLI is a public client, with none."""

    client_id: str
    secret: str | None = None

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"Client(client_id={self.client_id!r}, secret={'***' if self.secret else None})"


@dataclass(frozen=True)
class Tokens:
    id_token: str
    refresh_token: str | None
    expires_in: int | None  # the access token's lifetime, as the provider gave it


@dataclass(frozen=True)
class AuthorizationRequest:
    """One sign-in through a browser: what must come back (state), be in the ID token (nonce), and prove
    that the code is redeemed by whoever asked for it (the PKCE verifier)."""

    state: str
    nonce: str
    code_verifier: str
    redirect_uri: str

    @classmethod
    def new(cls, redirect_uri: str) -> AuthorizationRequest:
        return cls(
            secrets.token_urlsafe(32), secrets.token_urlsafe(32), secrets.token_urlsafe(48), redirect_uri
        )

    @property
    def code_challenge(self) -> str:
        return s256_challenge(self.code_verifier)

    def url(self, discovery: Discovery, client: Client, scopes: tuple[str, ...]) -> str:
        """The provider's authorization endpoint with this request's parameters."""
        params = {
            "response_type": "code",
            "client_id": client.client_id,
            "redirect_uri": self.redirect_uri,
            "scope": " ".join(scopes),
            "state": self.state,
            "nonce": self.nonce,
            "code_challenge": self.code_challenge,
            "code_challenge_method": "S256",
        }
        endpoint = discovery.authorization_endpoint
        return endpoint + ("&" if "?" in endpoint else "?") + urlencode(params, quote_via=quote)


def s256_challenge(verifier: str) -> str:
    """RFC 7636, 4.2: BASE64URL(SHA256(verifier)), without padding."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def exchange_code(discovery: Discovery, client: Client, request: AuthorizationRequest, code: str) -> Tokens:
    """The tokens the provider gives for `code`, sent with the request's PKCE verifier."""
    form = {"grant_type": "authorization_code", "code": code, "redirect_uri": request.redirect_uri,
            "code_verifier": request.code_verifier}  # fmt: skip
    return _token_request(discovery, client, form, "code exchange")


def refresh(discovery: Discovery, client: Client, refresh_token: str, scopes: tuple[str, ...] = ()) -> Tokens:
    """New tokens for a refresh token. A provider that rotates refresh tokens sends a new one: use it."""
    form = {"grant_type": "refresh_token", "refresh_token": refresh_token}
    if scopes:
        form["scope"] = " ".join(scopes)
    return _token_request(discovery, client, form, "refresh", keep_refresh_token=refresh_token)


@dataclass(frozen=True)
class DeviceAuthorization:
    """RFC 8628, 3.2: what the user is shown, and what the client polls with."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    expires_in: int
    interval: int


def start_device_flow(discovery: Discovery, client: Client, scopes: tuple[str, ...]) -> DeviceAuthorization:
    if discovery.device_authorization_endpoint is None:
        raise ProviderError(f"{discovery.issuer}: the provider offers no device authorization flow")
    form = {"scope": " ".join(scopes)}
    auth, credentials = _credentials(discovery, client)
    status, body = post_form(
        discovery.device_authorization_endpoint,
        {**form, **credentials},
        "OIDC device authorization",
        auth=auth,
    )
    if status != 200:
        raise SignInFailed(f"device authorization refused: {_error_text(body, status)}")
    try:
        return DeviceAuthorization(
            device_code=_required(body, "device_code"),
            user_code=_required(body, "user_code"),
            verification_uri=_required(body, "verification_uri"),
            verification_uri_complete=body.get("verification_uri_complete") or None,
            expires_in=int(body["expires_in"]),
            interval=max(0, int(body.get("interval", 5))),  # RFC 8628, 3.2: 5 s when not given
        )
    except (KeyError, TypeError, ValueError):
        raise ProviderError("device authorization: expires_in (and interval) must be numbers") from None


def poll_device_flow(
    discovery: Discovery,
    client: Client,
    device: DeviceAuthorization,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Tokens:
    """Poll the token endpoint every `interval` seconds until the user approves (the tokens), denies, or
    the code expires (SignInFailed); `slow_down` adds SLOW_DOWN_STEP_S to the interval for good."""
    interval, deadline = device.interval, clock() + device.expires_in
    auth, credentials = _credentials(discovery, client)
    form = {"grant_type": DEVICE_GRANT, "device_code": device.device_code, **credentials}
    while True:
        sleep(interval)
        if clock() > deadline:
            raise SignInFailed("the user code expired before it was approved: run gpuforge login again")
        status, body = post_form(discovery.token_endpoint, form, "OIDC token endpoint", auth=auth)
        if status == 200:
            return _tokens(body, "device flow")
        error = body.get("error")
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_STEP_S
            continue
        if error == "expired_token":
            raise SignInFailed("the user code expired before it was approved: run gpuforge login again")
        if error == "access_denied":
            raise SignInFailed("the sign-in was denied at the provider")
        raise SignInFailed(f"device flow: {_error_text(body, status)}")


def _token_request(
    discovery: Discovery,
    client: Client,
    form: dict[str, str],
    what: str,
    keep_refresh_token: str | None = None,
) -> Tokens:
    auth, credentials = _credentials(discovery, client)
    status, body = post_form(
        discovery.token_endpoint, {**form, **credentials}, "OIDC token endpoint", auth=auth
    )
    if status != 200:
        raise SignInFailed(f"{what} refused: {_error_text(body, status)}")
    tokens = _tokens(body, what)
    if tokens.refresh_token is None and keep_refresh_token:  # a provider that does not rotate them
        tokens = Tokens(tokens.id_token, keep_refresh_token, tokens.expires_in)
    return tokens


def _credentials(discovery: Discovery, client: Client) -> tuple[tuple[str, str] | None, dict[str, str]]:
    """How the client proves itself at the token endpoint: HTTP Basic (each part form-urlencoded, RFC
    6749, 2.3.1) for a confidential client, in the POST body where the provider takes only that; a
    public client sends its id alone."""
    if not client.secret:
        return None, {"client_id": client.client_id}
    if (
        "client_secret_basic" not in discovery.token_auth_methods
        and "client_secret_post" in discovery.token_auth_methods
    ):
        return None, {"client_id": client.client_id, "client_secret": client.secret}
    return (quote(client.client_id, safe=""), quote(client.secret, safe="")), {}


def _tokens(body: dict, what: str) -> Tokens:
    id_token = body.get("id_token")
    if not isinstance(id_token, str) or not id_token:
        raise SignInFailed(f"{what}: the provider sent no ID token (is `openid` among the scopes?)")
    refresh_token = body.get("refresh_token")
    expires_in = body.get("expires_in")
    return Tokens(
        id_token,
        refresh_token if isinstance(refresh_token, str) and refresh_token else None,
        int(expires_in) if isinstance(expires_in, int | float) else None,
    )


def _required(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ProviderError(f"device authorization: the provider sent no {name}")
    return value


def _error_text(body: dict, status: int) -> str:
    """The provider's error and description, cut short (an error text is the provider's, not ours)."""
    error = str(body.get("error") or f"HTTP {status}")[:100]
    description = body.get("error_description")
    return f"{error} ({str(description)[:300]})" if description else error
