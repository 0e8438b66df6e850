"""verify_id_token against a real oidc_provider's discovery and keys: what it accepts, and each refusal for
its own reason."""

import base64
import hashlib
import hmac
import json
import time

import pytest
from joserfc import jwt

from gpuforge.oidc.http import ProviderError
from gpuforge.oidc.issuer import Issuer
from gpuforge.oidc.verify import IdTokenVerifier, TokenRefused
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, new_key


def verifier(oidc_provider, **options) -> IdTokenVerifier:
    return IdTokenVerifier(Issuer(oidc_provider.issuer, **options), (DASHBOARD, CLI))


def refused(verifier: IdTokenVerifier, token: str, nonce: str | None = None) -> str:
    with pytest.raises(TokenRefused) as caught:
        verifier.verify_id_token(token, nonce=nonce)
    return caught.value.reason


def test_a_token_the_provider_signed_gives_its_claims(oidc_provider):
    claims = verifier(oidc_provider).verify_id_token(oidc_provider.mint({"nonce": "n-1"}), nonce="n-1")
    assert (claims.subject, claims.issuer) == (ALICE.sub, oidc_provider.issuer)
    assert (claims.name, claims.email, claims.groups) == (ALICE.name, ALICE.email, ALICE.groups)


def test_the_groups_claim_is_the_one_configured_and_one_string_is_one_group(oidc_provider):
    token = oidc_provider.mint({"roles": "admins"})
    claims = IdTokenVerifier(
        Issuer(oidc_provider.issuer), (DASHBOARD,), groups_claim="roles"
    ).verify_id_token(token)
    assert claims.groups == ("admins",)


def test_an_expired_token_is_refused(oidc_provider):
    now = int(time.time())
    assert (
        refused(verifier(oidc_provider), oidc_provider.mint({"iat": now - 7200, "exp": now - 3600}))
        == "expired"
    )


def test_expiry_allows_a_small_clock_skew(oidc_provider):
    now = int(time.time())
    verifier(oidc_provider).verify_id_token(oidc_provider.mint({"iat": now - 600, "exp": now - 10}))


def test_a_token_from_the_future_is_refused(oidc_provider):
    now = int(time.time())
    assert refused(verifier(oidc_provider), oidc_provider.mint({"nbf": now + 3600})) == "not_yet_valid"
    assert refused(verifier(oidc_provider), oidc_provider.mint({"iat": now + 3600})) == "not_yet_valid"


def test_a_token_signed_by_another_key_is_refused(oidc_provider):
    forged = new_key(oidc_provider.signing_key.kid)  # the oidc_provider's key id, an attacker's key
    assert refused(verifier(oidc_provider), oidc_provider.mint(key=forged)) == "signature"


def test_a_token_whose_key_id_the_provider_never_published_is_refused(oidc_provider):
    assert refused(verifier(oidc_provider), oidc_provider.mint(key=new_key("not-published"))) == "key"


def test_a_wrong_audience_is_refused(oidc_provider):
    assert refused(verifier(oidc_provider), oidc_provider.mint(audience="another-app")) == "audience"


def test_several_audiences_need_our_client_as_authorized_party(oidc_provider):
    both = [DASHBOARD, "another-app"]
    assert refused(verifier(oidc_provider), oidc_provider.mint({"aud": both})) == "audience"
    assert (
        refused(verifier(oidc_provider), oidc_provider.mint({"aud": both, "azp": "another-app"}))
        == "audience"
    )
    verifier(oidc_provider).verify_id_token(oidc_provider.mint({"aud": both, "azp": DASHBOARD}))


def test_a_wrong_issuer_is_refused(oidc_provider):
    assert refused(verifier(oidc_provider), oidc_provider.mint({"iss": "https://evil.example"})) == "issuer"


def test_a_replayed_nonce_is_refused(oidc_provider):
    check = verifier(oidc_provider)
    token = oidc_provider.mint({"nonce": "once"})
    check.verify_id_token(token, nonce="once")
    assert refused(check, token, nonce="once") == "replayed"
    assert (
        refused(check, oidc_provider.mint({"nonce": "once"}), nonce="once") == "replayed"
    )  # a fresh token too


def test_a_token_without_the_sign_ins_nonce_is_refused(oidc_provider):
    assert refused(verifier(oidc_provider), oidc_provider.mint({"nonce": "theirs"}), nonce="ours") == "nonce"
    assert refused(verifier(oidc_provider), oidc_provider.mint(), nonce="ours") == "nonce"


def test_alg_none_is_refused(oidc_provider):
    now = int(time.time())
    claims = {"iss": oidc_provider.issuer, "sub": "mallory", "aud": DASHBOARD, "iat": now, "exp": now + 600}
    with pytest.warns(Warning):  # joserfc warns of `none` as it makes the token
        unsigned = jwt.encode({"alg": "none"}, claims, None, algorithms=["none"])
    assert refused(verifier(oidc_provider), unsigned) == "algorithm"
    assert refused(verifier(oidc_provider), unsigned.rsplit(".", 1)[0] + ".") == "algorithm"


def test_an_hmac_made_with_the_providers_public_key_is_refused(oidc_provider):
    # the classic confusion: HS256 "signed" with the public key anyone fetches from jwks_uri (made by
    # hand: joserfc itself will not use a public key as an HMAC secret)
    header = {"alg": "HS256", "typ": "JWT", "kid": oidc_provider.signing_key.kid}
    now = int(time.time())
    claims = {"iss": oidc_provider.issuer, "sub": "mallory", "aud": DASHBOARD, "iat": now, "exp": now + 600}
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    secret = oidc_provider.signing_key.as_pem(private=False)
    token = f"{signing_input}.{b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"
    assert refused(verifier(oidc_provider), token) == "algorithm"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_an_algorithm_the_provider_does_not_advertise_is_refused(oidc_provider):
    any_rsa = new_key(oidc_provider.signing_key.kid, alg=None)
    assert (
        refused(verifier(oidc_provider), oidc_provider.mint(key=any_rsa, alg="PS256")) == "algorithm"
    )  # it says RS256


def test_garbage_is_malformed(oidc_provider):
    for token in ("", "a.b", "a.b.c", "x" * 20000, "e30.e30.e30.e30.e30"):
        assert refused(verifier(oidc_provider), token) == "malformed"


def test_a_rotated_key_is_fetched_once(oidc_provider):
    check = verifier(oidc_provider, refetch_after_s=0)
    check.verify_id_token(oidc_provider.mint())
    oidc_provider.rotate_key()
    check.verify_id_token(oidc_provider.mint())  # key-2: not in the cached set, found on the one refetch


def test_unknown_key_ids_do_not_make_a_request_each(oidc_provider, monkeypatch):
    made_up = [oidc_provider.mint(key=new_key(f"made-up-{n}")) for n in range(5)]
    check = verifier(oidc_provider, refetch_after_s=3600)
    check.verify_id_token(oidc_provider.mint())
    fetched = []
    monkeypatch.setattr("gpuforge.oidc.issuer.get_json", lambda *a: fetched.append(a) or {"keys": []})
    for token in made_up:
        assert refused(check, token) == "key"
    assert fetched == []


def test_discovery_must_name_the_issuer_exactly(oidc_provider):
    with pytest.raises(ProviderError, match="must match"):
        Issuer(oidc_provider.issuer + "/").discovery()


def test_a_plain_http_issuer_off_loopback_is_refused():
    with pytest.raises(ProviderError, match="https"):
        Issuer("http://sso.example.com")


def test_a_provider_out_of_reach_is_not_a_refused_token(oidc_provider, monkeypatch):
    check = verifier(oidc_provider)
    check.issuer.discovery()

    def unreachable(url, what):
        raise ProviderError(f"{what} {url}: unreachable")

    monkeypatch.setattr("gpuforge.oidc.issuer.get_json", unreachable)
    with pytest.raises(ProviderError, match="unreachable") as caught:
        check.verify_id_token(oidc_provider.mint())
    assert not isinstance(caught.value, TokenRefused)
