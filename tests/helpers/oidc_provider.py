"""A real OpenID Connect provider on 127.0.0.1, for tests: Authlib's authorization server (its
authorization-code grant with PKCE and OpenID Connect, refresh, device-authorization grants) over a small
Starlette app, served by uvicorn in a thread.

    with running_provider() as provider:        # an RSA key made now, a free port
        provider.issuer                          # http://127.0.0.1:PORT
        provider.register_client("gpuforge", secret="s3cret", redirect_uris=[...])
        provider.approve(user_code)              # what a user does at /device in a browser

Its one user, ALICE, is signed in and consents at once: /authorize answers with the redirect back to the
client, as a provider does for a user who signed in before. Everything else is as a provider does it:
signed ID tokens (RS256, the key's id in the header), discovery, JWKS, codes redeemed once with their
PKCE verifier, refresh tokens rotated, device codes polled with authorization_pending and slow_down.
`mint()` signs any claims with the provider's key (or another), for the tests of what a verifier refuses.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import uvicorn
from authlib.oauth2 import AuthorizationServer, OAuth2Error
from authlib.oauth2.rfc6749 import (
    AuthorizationCodeMixin,
    ClientMixin,
    OAuth2Payload,
    OAuth2Request,
    TokenMixin,
)
from authlib.oauth2.rfc6749.grants import AuthorizationCodeGrant, RefreshTokenGrant
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oauth2.rfc8628 import DeviceAuthorizationEndpoint, DeviceCodeGrant, DeviceCredentialDict
from authlib.oidc.core import UserInfo
from authlib.oidc.core.grants import OpenIDCode, OpenIDToken
from joserfc import jwt
from joserfc.jwk import RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

START_TIMEOUT_S = 30.0
# gpuforge as registered at the provider by the fixtures: the dashboard (confidential) and the CLI (public)
DASHBOARD, CLI, SECRET = "gpuforge", "gpuforge-cli", "dashboard-secret"
DASHBOARD_CALLBACK = "http://testserver/auth/oidc/callback"
SCOPES = ("openid", "profile", "email", "groups", "offline_access")
ALL_GRANTS = ("authorization_code", "refresh_token", DeviceCodeGrant.GRANT_TYPE)


@dataclass(frozen=True)
class User:
    sub: str
    name: str
    email: str
    groups: tuple[str, ...]


ALICE = User("alice-0001", "Alice Liddell", "alice@example.org", ("ml-team", "gpu-admins"))


@dataclass
class RegisteredClient(ClientMixin):
    client_id: str
    secret: str | None  # None: a public client (the CLI)
    redirect_uris: tuple[str, ...]
    grant_types: tuple[str, ...]

    def get_client_id(self):
        return self.client_id

    def get_default_redirect_uri(self):
        return self.redirect_uris[0] if self.redirect_uris else None

    def get_allowed_scope(self, scope):
        return " ".join(s for s in (scope or "").split() if s in SCOPES)

    def check_redirect_uri(self, redirect_uri):
        if redirect_uri in self.redirect_uris:
            return True
        # RFC 8252, 7.3: a native (public) client's loopback redirect, on whatever port it got
        parts = urlsplit(redirect_uri)
        if self.secret is not None or parts.scheme != "http" or parts.hostname != "127.0.0.1" or parts.query:
            return False
        return any(
            urlsplit(uri).hostname == "127.0.0.1" and urlsplit(uri).path == parts.path
            for uri in self.redirect_uris
        )

    def check_client_secret(self, client_secret):
        return self.secret is not None and secrets.compare_digest(self.secret, client_secret)

    def check_endpoint_auth_method(self, method, endpoint):
        if self.secret is None:
            return method == "none"
        return method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type):
        return response_type == "code"

    def check_grant_type(self, grant_type):
        return grant_type in self.grant_types


@dataclass
class IssuedCode(AuthorizationCodeMixin):
    code: str
    client_id: str
    redirect_uri: str
    scope: str
    user: User
    nonce: str | None
    code_challenge: str | None
    code_challenge_method: str | None
    auth_time: int = field(default_factory=lambda: int(time.time()))

    def get_redirect_uri(self):
        return self.redirect_uri

    def get_scope(self):
        return self.scope

    def get_nonce(self):
        return self.nonce

    def get_auth_time(self):
        return self.auth_time

    def get_acr(self):
        return None

    def get_amr(self):
        return None


@dataclass
class IssuedRefreshToken(TokenMixin):
    token: str
    client_id: str
    scope: str
    user: User
    revoked: bool = False

    def check_client(self, client):
        return client.get_client_id() == self.client_id

    def get_scope(self):
        return self.scope

    def get_expires_in(self):
        return 86400

    def is_expired(self):
        return False

    def is_revoked(self):
        return self.revoked


class _Payload(OAuth2Payload):
    def __init__(self, pairs: list[tuple[str, str]]):
        self._datalist: dict[str, list[str]] = defaultdict(list)
        for key, value in pairs:
            self._datalist[key].append(value)
        self._data = {key: values[0] for key, values in self._datalist.items()}

    @property
    def data(self):
        return self._data

    @property
    def datalist(self):
        return self._datalist


class _Request(OAuth2Request):
    """A Starlette request as Authlib's server reads one: its query and form together, as Flask's
    `request.values`."""

    def __init__(
        self, method: str, url: str, headers, query: list[tuple[str, str]], form: list[tuple[str, str]]
    ):
        super().__init__(method, url, headers=headers)
        self.payload = _Payload(query + form)
        self._query, self._form = dict(query), dict(form)

    @property
    def args(self):
        return self._query

    @property
    def form(self):
        return self._form


async def _oauth_request(request: Request) -> _Request:
    body = (await request.body()).decode() if request.method == "POST" else ""
    query = list(request.query_params.multi_items())
    return _Request(request.method, str(request.url), request.headers, query, parse_qsl(body))


class Provider(AuthorizationServer):
    """The provider's state (keys, clients, codes, tokens, device codes) and its Authlib server."""

    def __init__(
        self, issuer: str, device_flow: bool = True, device_interval: int = 0, id_token_ttl_s: int = 3600
    ):
        super().__init__(scopes_supported=list(SCOPES))
        self.issuer, self.device_flow = issuer, device_flow
        self.device_interval, self.id_token_ttl_s = device_interval, id_token_ttl_s
        self.keys = [new_key("key-1")]
        self.clients: dict[str, RegisteredClient] = {}
        self.codes: dict[str, IssuedCode] = {}
        self.refresh_tokens: dict[str, IssuedRefreshToken] = {}
        self.device_codes: dict[str, DeviceCredentialDict] = {}
        self.user_grants: dict[str, tuple[User, bool]] = {}
        self.last_poll: dict[str, float] = {}
        self.nonces: set[str] = set()
        self.device_code_issued = threading.Event()
        self.token_requests = 0
        self.register_token_generator(
            "default",
            BearerTokenGenerator(
                lambda *a, **k: secrets.token_urlsafe(32), lambda *a, **k: secrets.token_urlsafe(32)
            ),  # fmt: skip
        )
        id_tokens = _IdTokens(self)
        self.register_grant(_CodeGrant, [CodeChallenge(required=True), _IdTokensForCodes(self)])
        self.register_grant(_RefreshGrant, [id_tokens])
        if device_flow:
            self.register_grant(_DeviceGrant, [id_tokens])
            self.register_endpoint(_DeviceEndpoint(self))

    @property
    def signing_key(self) -> RSAKey:
        return self.keys[-1]

    # --- what tests do ---
    def register_client(self, client_id: str, secret: str | None = None, redirect_uris=(),
                        grant_types=ALL_GRANTS) -> None:  # fmt: skip
        self.clients[client_id] = RegisteredClient(
            client_id, secret, tuple(redirect_uris), tuple(grant_types)
        )

    def rotate_key(self) -> RSAKey:
        """A new signing key, published beside the old one (as providers roll keys)."""
        self.keys.append(new_key(f"key-{len(self.keys) + 1}"))
        return self.signing_key

    def mint(self, claims: dict[str, Any] | None = None, key: RSAKey | None = None, alg: str = "RS256",
             header: dict[str, Any] | None = None, audience: str = "gpuforge") -> str:  # fmt: skip
        """An ID token for ALICE as this provider would sign it, with `claims` changed (a None value
        drops a claim), signed with `key` (default: the provider's)."""
        key = key or self.signing_key
        now = int(time.time())
        body = {"iss": self.issuer, "sub": ALICE.sub, "aud": audience, "iat": now, "exp": now + 600,
                "name": ALICE.name, "email": ALICE.email, "groups": list(ALICE.groups)}  # fmt: skip
        for name, value in (claims or {}).items():
            if value is None:
                body.pop(name, None)
            else:
                body[name] = value
        return jwt.encode({"alg": alg, "kid": key.kid, **(header or {})}, body, key, algorithms=[alg])

    def approve(self, user_code: str, approved: bool = True) -> None:
        self.user_grants[user_code] = (ALICE, approved)

    def expire_device_codes(self) -> None:
        for credential in self.device_codes.values():
            credential["expires_at"] = time.time() - 1

    # --- Authlib's framework hooks ---
    def query_client(self, client_id):
        return self.clients.get(client_id)

    def save_token(self, token, request):
        if "refresh_token" in token:
            self.refresh_tokens[token["refresh_token"]] = IssuedRefreshToken(
                token["refresh_token"], request.client.get_client_id(), token.get("scope", ""), request.user
            )

    def create_oauth2_request(self, request):
        return request  # the routes build it (Starlette reads a body asynchronously)

    def create_json_request(self, request):
        raise NotImplementedError

    def handle_response(self, status_code, payload, headers):
        headers = dict(headers)
        if isinstance(payload, dict):
            return JSONResponse(payload, status_code, headers={k: v for k, v in headers.items()
                                                               if k.lower() != "content-type"})  # fmt: skip
        return Response(payload, status_code, headers=headers)

    def send_signal(self, name, *args, **kwargs):
        pass

    # --- routes ---
    def app(self) -> Starlette:
        routes = [
            Route("/.well-known/openid-configuration", self.discovery_route),
            Route("/jwks", self.jwks_route),
            Route("/authorize", self.authorize_route),
            Route("/token", self.token_route, methods=["POST"]),
        ]
        if self.device_flow:
            routes += [
                Route("/device_authorization", self.device_authorization_route, methods=["POST"]),
                Route("/device", self.device_route, methods=["GET", "POST"]),
            ]
        return Starlette(routes=routes)

    async def discovery_route(self, request: Request) -> Response:
        doc = {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "scopes_supported": list(SCOPES),
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post", "none"],
            "code_challenge_methods_supported": ["S256"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
        }
        if self.device_flow:
            doc["device_authorization_endpoint"] = f"{self.issuer}/device_authorization"
            doc["grant_types_supported"].append(DeviceCodeGrant.GRANT_TYPE)
        return JSONResponse(doc)

    async def jwks_route(self, request: Request) -> Response:
        return JSONResponse({"keys": [key.as_dict(private=False) for key in self.keys]})

    async def authorize_route(self, request: Request) -> Response:
        oauth_request = await _oauth_request(request)
        try:
            grant = self.get_consent_grant(oauth_request, end_user=ALICE)
        except OAuth2Error as error:
            return self.handle_error_response(oauth_request, error)
        return self.create_authorization_response(oauth_request, grant_user=ALICE, grant=grant)

    async def token_route(self, request: Request) -> Response:
        self.token_requests += 1
        return self.create_token_response(await _oauth_request(request))

    async def device_authorization_route(self, request: Request) -> Response:
        return self.create_endpoint_response("device_authorization", await _oauth_request(request))

    async def device_route(self, request: Request) -> Response:
        """The page a user types the code into (GET), and the approval it posts (POST user_code)."""
        if request.method == "GET":
            return HTMLResponse('<form method="post"><input name="user_code"><button>Approve</button></form>')
        form = dict(parse_qsl((await request.body()).decode()))
        code = form.get("user_code", "")
        if not any(c["user_code"] == code for c in self.device_codes.values()):
            return HTMLResponse("unknown code", 400)
        self.approve(code, approved=form.get("deny") is None)
        return HTMLResponse("approved: return to your terminal")


def new_key(kid: str, alg: str | None = "RS256") -> RSAKey:
    """An RSA signing key; `alg` None: one any RSA algorithm may use."""
    return RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig", **({"alg": alg} if alg else {})})


class _IdTokens(OpenIDToken):
    """ID tokens for the refresh and device grants (Authlib's OpenIDCode does the code grant's)."""

    def __init__(self, provider: Provider):
        self.provider = provider

    def resolve_client_private_key(self, client):
        return self.provider.signing_key

    def get_client_algorithm(self, client):
        return "RS256"

    def get_encode_header(self, client):
        return {"alg": "RS256", "kid": self.provider.signing_key.kid}

    def get_client_claims(self, client):
        now = int(time.time())
        return {
            "iss": self.provider.issuer,
            "aud": [client.get_client_id()],
            "exp": now + self.provider.id_token_ttl_s,
        }

    def generate_user_info(self, user, scope):
        info = UserInfo(sub=user.sub, name=user.name)
        if "email" in scope.split():
            info["email"] = user.email
        if "groups" in scope.split():
            info["groups"] = list(user.groups)
        return info


class _IdTokensForCodes(_IdTokens, OpenIDCode):
    def __init__(self, provider: Provider):
        _IdTokens.__init__(self, provider)
        OpenIDCode.__init__(self, require_nonce=True)

    def exists_nonce(self, nonce, request):
        return nonce in self.provider.nonces  # recorded with the code it was issued with


class _CodeGrant(AuthorizationCodeGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post", "none"]

    def save_authorization_code(self, code, request):
        data = request.payload.data
        self.server.nonces.add(data.get("nonce"))
        self.server.codes[code] = IssuedCode(
            code, request.client.get_client_id(), request.payload.redirect_uri, request.scope, request.user,
            data.get("nonce"), data.get("code_challenge"), data.get("code_challenge_method"),
        )  # fmt: skip

    def query_authorization_code(self, code, client):
        found = self.server.codes.get(code)
        return found if found and found.client_id == client.get_client_id() else None

    def delete_authorization_code(self, authorization_code):
        self.server.codes.pop(authorization_code.code, None)

    def authenticate_user(self, authorization_code):
        return authorization_code.user


class _RefreshGrant(RefreshTokenGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post", "none"]
    INCLUDE_NEW_REFRESH_TOKEN = True  # rotated: the old one is revoked

    def authenticate_refresh_token(self, refresh_token):
        found = self.server.refresh_tokens.get(refresh_token)
        return found if found and not found.revoked else None

    def authenticate_user(self, refresh_token):
        return refresh_token.user

    def revoke_old_credential(self, refresh_token):
        refresh_token.revoked = True


class _DeviceGrant(DeviceCodeGrant):
    def query_device_credential(self, device_code):
        return self.server.device_codes.get(device_code)

    def query_user_grant(self, user_code):
        return self.server.user_grants.get(user_code)

    def should_slow_down(self, credential):
        """RFC 8628, 3.5: polled again sooner than the interval."""
        now, code = time.monotonic(), credential["device_code"]
        last, self.server.last_poll[code] = self.server.last_poll.get(code), now
        return last is not None and now - last < self.server.device_interval


class _DeviceEndpoint(DeviceAuthorizationEndpoint):
    def __init__(self, provider: Provider):
        super().__init__(provider)
        self.INTERVAL = provider.device_interval

    def get_verification_uri(self):
        return f"{self.server.issuer}/device"

    def save_device_credential(self, client_id, scope, data):
        self.server.device_codes[data["device_code"]] = DeviceCredentialDict(
            client_id=client_id, scope=scope, expires_at=time.time() + data["expires_in"], **data
        )
        self.server.device_code_issued.set()


@contextmanager
def serving(app, name: str = "server") -> Iterator[str]:
    """`app` (ASGI) served by uvicorn in a thread on 127.0.0.1 at a free port: its base URL. The socket is
    bound before the thread starts, so there is no race for the port; stopped on leaving."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name=name, daemon=True
    )
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"{name} did not start in {START_TIMEOUT_S} s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()


@contextmanager
def running_provider(**options: Any) -> Iterator[Provider]:
    """A Provider served on loopback, its issuer URL its own address (see Provider for `options`)."""
    holder: dict[str, Provider] = {}

    async def app(scope, receive, send):  # the issuer is known only once the port is
        await holder["app"](scope, receive, send)

    with serving(app, "oidc-provider") as url:
        provider = Provider(url, **options)
        holder["provider"], holder["app"] = provider, provider.app()
        yield provider


def with_gpuforge_clients(provider: Provider) -> Provider:
    provider.register_client(DASHBOARD, secret=SECRET, redirect_uris=[DASHBOARD_CALLBACK])
    provider.register_client(CLI, redirect_uris=["http://127.0.0.1/callback"])  # any loopback port
    return provider


# fixtures for every test (tests/conftest.py names this module in pytest_plugins)
@pytest.fixture
def start_provider():
    """start_provider(**options): a provider (Provider's options) with gpuforge's two clients, on loopback
    until the test ends."""
    with ExitStack() as stack:
        yield lambda **options: with_gpuforge_clients(stack.enter_context(running_provider(**options)))


@pytest.fixture
def oidc_provider(start_provider) -> Provider:
    """A provider with the device flow, polled with no wait (interval 0)."""
    return start_provider()
