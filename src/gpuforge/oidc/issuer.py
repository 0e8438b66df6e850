"""One OpenID provider as gpuforge knows it: its discovery document and its signing keys, both cached.

    issuer = Issuer("https://sso.example.com/realms/lab")
    issuer.discovery().token_endpoint      # fetched once, then kept DISCOVERY_TTL_S
    issuer.key_for("kid-2024", "RS256")    # from the cached key set; fetched again once for a new kid

The discovery document must name the issuer exactly as configured (OpenID Connect Discovery 1.0, 4.3): a
document that names another is refused, so that a redirected or spoofed document cannot swap issuers.
A key id the cached set lacks is how a provider's key rotation looks from here: the set is fetched again,
once, and no sooner than `refetch_after_s` after the last fetch (an attacker's tokens with made-up key ids
must not become a stream of requests to the provider).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from joserfc.errors import JoseError
from joserfc.jwk import ECKey, Key, RSAKey, import_key

from gpuforge.oidc.http import ProviderError, check_url, get_json

SIGNING_ALGORITHMS = ("RS256", "PS256", "ES256")  # asymmetric only: never `none`, never an HMAC (HS*)
KEY_TYPE_OF = {"RS256": RSAKey, "PS256": RSAKey, "ES256": ECKey}
DISCOVERY_TTL_S = 3600.0
KEYS_TTL_S = 3600.0
REFETCH_AFTER_S = 10.0


class UnknownKey(ProviderError):
    """The provider publishes no key with a token's key id (for its algorithm)."""


@dataclass(frozen=True)
class Discovery:
    """What gpuforge uses of a provider's /.well-known/openid-configuration."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    device_authorization_endpoint: str | None
    signing_algorithms: tuple[str, ...]  # those it advertises among SIGNING_ALGORITHMS
    scopes_supported: tuple[str, ...]
    token_auth_methods: tuple[str, ...]  # token_endpoint_auth_methods_supported

    @property
    def device_flow(self) -> bool:
        return self.device_authorization_endpoint is not None


class Issuer:
    """An issuer's discovery document and key set, cached; safe to share between threads."""

    def __init__(self, issuer: str, refetch_after_s: float = REFETCH_AFTER_S):
        self.issuer = check_url(issuer, "OIDC issuer")
        self.refetch_after_s = refetch_after_s
        self._lock = threading.Lock()
        self._discovery: tuple[Discovery, float] | None = None
        self._keys: tuple[list[Key], float] | None = None

    def discovery(self) -> Discovery:
        with self._lock:
            if self._discovery is None or time.monotonic() - self._discovery[1] > DISCOVERY_TTL_S:
                self._discovery = (fetch_discovery(self.issuer), time.monotonic())
            return self._discovery[0]

    def key_for(self, kid: str | None, alg: str) -> Key:
        """The provider's public key that signed a token with header `kid`, `alg`; UnknownKey when the
        provider has none (after one fetch of a fresh key set, for a kid not seen yet), ProviderError
        when its key set cannot be had."""
        found = _pick(self._cached_keys(), kid, alg)
        if found is None:
            with self._lock:
                fetched_at = self._keys[1] if self._keys else float("-inf")
                if time.monotonic() - fetched_at >= self.refetch_after_s:  # a rotation: look once more
                    self._keys = (self._fetch_keys(), time.monotonic())
                found = _pick(self._keys[0], kid, alg) if self._keys else None
        if found is None:
            raise UnknownKey(f"the provider's key set has no {alg} key with id {kid!r}")
        return found

    def _cached_keys(self) -> list[Key]:
        with self._lock:
            if self._keys is None or time.monotonic() - self._keys[1] > KEYS_TTL_S:
                self._keys = (self._fetch_keys(), time.monotonic())
            return self._keys[0]

    def _fetch_keys(self) -> list[Key]:
        uri = self._discovery[0].jwks_uri if self._discovery else None
        if uri is None:  # called under the lock: discovery() would wait on itself
            self._discovery = (fetch_discovery(self.issuer), time.monotonic())
            uri = self._discovery[0].jwks_uri
        return parse_key_set(get_json(uri, "OIDC key set (jwks_uri)"))


def fetch_discovery(issuer: str) -> Discovery:
    """The provider's discovery document, checked: the issuer it names is `issuer` exactly, its endpoints
    are https (or loopback), and it signs ID tokens with an algorithm gpuforge accepts."""
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    doc = get_json(url, "OIDC discovery")
    if doc.get("issuer") != issuer:
        raise ProviderError(
            f"OIDC discovery {url}: names issuer {doc.get('issuer')!r}, not {issuer!r} (they must match "
            "exactly, trailing slash included)"
        )

    def endpoint(name: str, required: bool = True) -> str | None:
        value = doc.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise ProviderError(f"OIDC discovery {url}: no {name}")
        return check_url(value, f"OIDC discovery's {name}")

    advertised = _strings(doc.get("id_token_signing_alg_values_supported"))
    algorithms = tuple(alg for alg in SIGNING_ALGORITHMS if alg in advertised)
    if not algorithms:
        raise ProviderError(
            f"OIDC discovery {url}: signs ID tokens with {list(advertised)}; gpuforge accepts "
            f"{', '.join(SIGNING_ALGORITHMS)}"
        )
    challenges = doc.get("code_challenge_methods_supported")
    if challenges is not None and "S256" not in _strings(challenges):
        raise ProviderError(f"OIDC discovery {url}: no PKCE with S256 (code_challenge_methods_supported)")
    return Discovery(
        issuer=issuer,
        authorization_endpoint=endpoint("authorization_endpoint"),
        token_endpoint=endpoint("token_endpoint"),
        jwks_uri=endpoint("jwks_uri"),
        device_authorization_endpoint=endpoint("device_authorization_endpoint", required=False),
        signing_algorithms=algorithms,
        scopes_supported=_strings(doc.get("scopes_supported")),
        token_auth_methods=_strings(doc.get("token_endpoint_auth_methods_supported"))
        or ("client_secret_basic",),  # the default the discovery spec gives
    )


def parse_key_set(doc: dict) -> list[Key]:
    """The signing keys of a JWKS document (RSA and EC public keys; others, and encryption keys, left
    out). A key is imported as public even if the document, wrongly, holds its private half."""
    keys = []
    for entry in doc.get("keys") or []:
        if (
            not isinstance(entry, dict)
            or entry.get("use", "sig") != "sig"
            or entry.get("kty") not in ("RSA", "EC")
        ):
            continue
        public = {k: v for k, v in entry.items() if k not in ("d", "p", "q", "dp", "dq", "qi")}
        try:
            keys.append(import_key(public))
        except (JoseError, ValueError, TypeError):
            continue  # one unreadable key does not hide the others
    if not keys:
        raise ProviderError("OIDC key set (jwks_uri): holds no RSA or EC signing key")
    return keys


def _pick(keys: list[Key], kid: str | None, alg: str) -> Key | None:
    kind = KEY_TYPE_OF[alg]
    fitting = [k for k in keys if isinstance(k, kind) and k.get("alg", alg) == alg]
    if kid is not None:
        return next((k for k in fitting if k.kid == kid), None)
    return fitting[0] if len(fitting) == 1 else None  # no kid: only an unambiguous key will do


def _strings(value) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()
