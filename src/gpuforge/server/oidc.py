"""Single sign-on for the dashboard and the CLI: the server's side (the protocol is gpuforge/oidc/).

    sso = OidcSignIn(oidc_settings(settings), on_sign_in)   # None settings: no single sign-on
    app.include_router(sso.router())                         # and OPEN_PATHS open in RequireKey
    claims = sso.verify_bearer(token)                        # a CLI's `Authorization: Bearer <id_token>`

Routes (open: they are how one gets a credential):
- GET /auth/oidc/config: the issuer, the CLI's client id, its scopes, whether the device flow is offered
  (what `gpuforge login` asks first);
- GET /auth/oidc/start[?next=/path]: redirects the browser to the issuer (authorization-code flow, PKCE
  S256, a state and a nonce of its own);
- GET /auth/oidc/callback: redeems the code, verifies the ID token (nonce included) and hands the claims
  to `on_sign_in(request, claims, next_path)`, whose response is the answer (the integrator's: it maps
  the claims to a user and sets the dashboard's session; a plain function runs in the thread pool, an
  async one on the event loop).
"""

from __future__ import annotations

import hmac
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import SecretStr
from starlette.concurrency import run_in_threadpool

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.flows import AuthorizationRequest, Client, SignInFailed, exchange_code
from gpuforge.oidc.http import ProviderError, check_url
from gpuforge.oidc.issuer import Issuer
from gpuforge.oidc.verify import Claims, IdTokenVerifier, TokenRefused
from gpuforge.secret_files import read_secret_file

CONFIG_PATH, START_PATH, CALLBACK_PATH = "/auth/oidc/config", "/auth/oidc/start", "/auth/oidc/callback"
OPEN_PATHS = frozenset({CONFIG_PATH, START_PATH, CALLBACK_PATH})
STATE_COOKIE = "gpuforge_oidc_state"
SIGN_IN_TTL_S = 600  # from /start to /callback: a user who takes longer starts again
MAX_PENDING = 10_000  # sign-ins under way at once: /start is open, so its memory is bounded

OnSignIn = Callable[[Request, Claims, str], Response | Awaitable[Response]]


@dataclass(frozen=True)
class OidcSettings:
    issuer: str
    client_id: str
    client_secret: SecretStr | None = field(repr=False)
    cli_client_id: str
    scopes: tuple[str, ...] = ("openid", "profile", "email")
    groups_claim: str = "groups"
    redirect_uri: str | None = None


def oidc_settings(settings) -> OidcSettings | None:
    """The single sign-on the server's Settings ask for; None when no issuer is set. A GpuforgeError for
    an issuer without a client id (or the reverse), or a secret both in a file and in the environment."""
    if not settings.oidc_issuer and not settings.oidc_client_id:
        return None
    if not settings.oidc_issuer or not settings.oidc_client_id:
        raise GpuforgeError("--oidc-issuer and --oidc-client-id: single sign-on needs both")
    check_url(settings.oidc_issuer, "--oidc-issuer")
    secret = settings.oidc_client_secret
    if settings.oidc_client_secret_file is not None:
        if secret is not None:
            raise GpuforgeError(
                "GPUFORGE_OIDC_CLIENT_SECRET and --oidc-client-secret-file: give the secret in one of them"
            )
        path = settings.oidc_client_secret_file
        secret = SecretStr(read_secret_file(path, "--oidc-client-secret-file", "the OIDC client secret"))
    scopes = ("openid", *(s for s in settings.oidc_scopes.split() if s != "openid"))
    return OidcSettings(
        issuer=settings.oidc_issuer,
        client_id=settings.oidc_client_id,
        client_secret=secret,
        cli_client_id=settings.oidc_cli_client_id or settings.oidc_client_id,
        scopes=scopes,
        groups_claim=settings.oidc_groups_claim,
        redirect_uri=settings.oidc_redirect_uri,
    )


class PendingSignIns:
    """Sign-ins between /start and /callback, by state, each for SIGN_IN_TTL_S and redeemed once.

    Kept here rather than in a signed cookie: the PKCE verifier and the nonce never leave the server, a
    state is single-use by construction (popped), and there is no signing key to make, share or rotate.
    The browser gets only the state, in an HttpOnly, SameSite=Lax cookie scoped to /auth/oidc, and the
    callback must carry the same state as that cookie: a callback URL made in another browser (login
    CSRF: signing a victim in as the attacker) does not complete. The price: the callback must reach the
    server process that began the sign-in (one process per server today; a pool would need a shared
    store or sticky sessions)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[AuthorizationRequest, str, float]] = {}

    def add(self, request: AuthorizationRequest, next_path: str) -> bool:
        """Keep a sign-in; False when MAX_PENDING are under way already."""
        now = time.monotonic()
        with self._lock:
            for state in [s for s, (_, _, until) in self._pending.items() if until < now]:
                del self._pending[state]
            if len(self._pending) >= MAX_PENDING:
                return False
            self._pending[request.state] = (request, next_path, now + SIGN_IN_TTL_S)
            return True

    def redeem(self, state: str) -> tuple[AuthorizationRequest, str] | None:
        """The sign-in of `state` (forgotten from now on); None if unknown or expired."""
        with self._lock:
            found = self._pending.pop(state, None)
        if found is None or found[2] < time.monotonic():
            return None
        return found[0], found[1]


class OidcSignIn:
    """The server's single sign-on: its routes, and the check of a CLI's bearer ID token."""

    def __init__(self, config: OidcSettings, on_sign_in: OnSignIn, issuer: Issuer | None = None):
        self.config, self.on_sign_in = config, on_sign_in
        self.issuer = issuer or Issuer(config.issuer)
        audiences = tuple(dict.fromkeys((config.client_id, config.cli_client_id)))
        self.verifier = IdTokenVerifier(self.issuer, audiences, groups_claim=config.groups_claim)
        self.client = Client(
            config.client_id, config.client_secret.get_secret_value() if config.client_secret else None
        )
        self.pending = PendingSignIns()

    def verify_bearer(self, token: str) -> Claims:
        """The claims of an ID token a client presents (no nonce: the CLI's sign-in was its own);
        TokenRefused or ProviderError (both GpuforgeError) when it does not pass."""
        return self.verifier.verify_id_token(token)

    def router(self) -> APIRouter:
        router = APIRouter(tags=["single sign-on"])
        router.add_api_route(CONFIG_PATH, self.config_route, methods=["GET"], name="oidc_config")
        router.add_api_route(START_PATH, self.start, methods=["GET"], name="oidc_start")
        router.add_api_route(CALLBACK_PATH, self.callback, methods=["GET"], name="oidc_callback")
        return router

    async def config_route(self) -> JSONResponse:
        """The issuer and client id `gpuforge login` signs in with."""
        try:
            discovery = await run_in_threadpool(self.issuer.discovery)
        except ProviderError as err:
            return _refusal(502, str(err))
        return JSONResponse({
            "issuer": self.config.issuer, "client_id": self.config.cli_client_id,
            "scopes": list(self.config.scopes), "device_flow": discovery.device_flow,
        })  # fmt: skip

    async def start(self, request: Request, next: str = "/") -> Response:  # noqa: A002 (the query's name)
        """Send the browser to the issuer to sign in."""
        try:
            discovery = await run_in_threadpool(self.issuer.discovery)
        except ProviderError as err:
            return _refusal(502, str(err))
        redirect_uri = self.config.redirect_uri or str(request.url_for("oidc_callback"))
        sign_in = AuthorizationRequest.new(redirect_uri)
        if not self.pending.add(sign_in, local_path(next)):
            return _refusal(503, "too many sign-ins under way: try again in a few minutes")
        response = RedirectResponse(sign_in.url(discovery, self.client, self.config.scopes), status_code=303)
        https = redirect_uri.startswith("https://")  # behind a TLS proxy the request itself may read http
        response.set_cookie(
            STATE_COOKIE, sign_in.state, max_age=SIGN_IN_TTL_S, path="/auth/oidc", httponly=True,
            samesite="lax", secure=https,
        )  # fmt: skip
        return response

    async def callback(self, request: Request) -> Response:
        """Finish a sign-in: the issuer's redirect back, with a code (or an error)."""
        query = request.query_params
        state, cookie = query.get("state", ""), request.cookies.get(STATE_COOKIE, "")
        if not state or not hmac.compare_digest(state.encode(), cookie.encode()):
            return _refusal(
                400, "this sign-in was not started in this browser: start again at /auth/oidc/start"
            )
        found = self.pending.redeem(state)
        if found is None:
            return _refusal(400, "this sign-in expired or was finished already: start again")
        sign_in, next_path = found
        if "error" in query:
            return _refusal(401, f"the issuer refused the sign-in: {query['error'][:100]}")
        code = query.get("code")
        if not code:
            return _refusal(400, "the issuer's redirect carries no code")
        try:
            claims = await run_in_threadpool(self._redeem, sign_in, code)
        except (TokenRefused, SignInFailed) as err:
            return _refusal(401, str(err))
        except ProviderError as err:
            return _refusal(502, str(err))
        if inspect.iscoroutinefunction(self.on_sign_in):
            response = await self.on_sign_in(request, claims, next_path)
        else:  # the store is synchronous: a plain function runs off the event loop
            response = await run_in_threadpool(self.on_sign_in, request, claims, next_path)
        response.delete_cookie(STATE_COOKIE, path="/auth/oidc")
        return response

    def _redeem(self, sign_in: AuthorizationRequest, code: str) -> Claims:
        tokens = exchange_code(self.issuer.discovery(), self.client, sign_in, code)
        return self.verifier.verify_id_token(tokens.id_token, nonce=sign_in.nonce)


def local_path(next_path: str) -> str:
    """Where to go after signing in: a path on this server, never another site (`//evil`, `/\\evil`,
    an absolute URL, or a path with control characters, which browsers drop: all become /)."""
    unsafe = (
        next_path.startswith("//")
        or "\\" in next_path
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in next_path)
    )
    if not next_path.startswith("/") or unsafe or len(next_path) > 2000:
        return "/"
    return next_path


def _refusal(status: int, detail: str) -> JSONResponse:
    response = JSONResponse({"detail": detail}, status, headers={"Cache-Control": "no-store"})
    response.delete_cookie(STATE_COOKIE, path="/auth/oidc")
    return response
