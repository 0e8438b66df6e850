"""The client's exchanges with a real oidc_provider: the code flow with PKCE, refresh, the device flow."""

import threading

import httpx
import pytest

from gpuforge.oidc.flows import (
    AuthorizationRequest,
    Client,
    SignInFailed,
    exchange_code,
    poll_device_flow,
    refresh,
    start_device_flow,
)
from gpuforge.oidc.issuer import Issuer
from gpuforge.oidc.verify import IdTokenVerifier
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, DASHBOARD_CALLBACK, SECRET

DASHBOARD_CLIENT = Client(DASHBOARD, SECRET)
SCOPES = ("openid", "profile", "email", "groups")


def authorize(oidc_provider, request: AuthorizationRequest, client: Client = DASHBOARD_CLIENT) -> str:
    """What the browser brings back from the oidc_provider's authorization endpoint: the code."""
    url = request.url(Issuer(oidc_provider.issuer).discovery(), client, SCOPES)
    answer = httpx.get(url, follow_redirects=False)
    assert answer.status_code == 302, answer.text
    back = httpx.URL(answer.headers["location"])
    assert back.params["state"] == request.state
    return back.params["code"]


def test_the_code_flow_with_pkce_gives_a_verified_id_token(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    request = AuthorizationRequest.new(DASHBOARD_CALLBACK)
    tokens = exchange_code(discovery, DASHBOARD_CLIENT, request, authorize(oidc_provider, request))
    claims = IdTokenVerifier(Issuer(oidc_provider.issuer), (DASHBOARD,)).verify_id_token(
        tokens.id_token, request.nonce
    )
    assert (claims.subject, claims.groups) == (ALICE.sub, ALICE.groups)
    assert tokens.refresh_token


def test_a_pkce_verifier_that_does_not_match_is_refused(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    request = AuthorizationRequest.new(DASHBOARD_CALLBACK)
    code = authorize(oidc_provider, request)
    other = AuthorizationRequest.new(DASHBOARD_CALLBACK)  # another verifier: an intercepted code's thief
    thief = AuthorizationRequest(request.state, request.nonce, other.code_verifier, request.redirect_uri)
    with pytest.raises(SignInFailed, match="invalid_grant"):
        exchange_code(discovery, DASHBOARD_CLIENT, thief, code)


def test_a_code_is_redeemed_once(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    request = AuthorizationRequest.new(DASHBOARD_CALLBACK)
    code = authorize(oidc_provider, request)
    exchange_code(discovery, DASHBOARD_CLIENT, request, code)
    with pytest.raises(SignInFailed, match="invalid_grant"):
        exchange_code(discovery, DASHBOARD_CLIENT, request, code)


def test_a_wrong_client_secret_is_refused(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    request = AuthorizationRequest.new(DASHBOARD_CALLBACK)
    with pytest.raises(SignInFailed, match="invalid_client") as caught:
        exchange_code(discovery, Client(DASHBOARD, "guessed"), request, authorize(oidc_provider, request))
    assert "guessed" not in str(caught.value)


def test_the_client_secret_is_never_shown():
    assert SECRET not in repr(DASHBOARD_CLIENT)


def test_refresh_gives_a_new_id_token_and_rotates_the_refresh_token(oidc_provider):
    issuer = Issuer(oidc_provider.issuer)
    request = AuthorizationRequest.new(DASHBOARD_CALLBACK)
    first = exchange_code(issuer.discovery(), DASHBOARD_CLIENT, request, authorize(oidc_provider, request))
    second = refresh(issuer.discovery(), DASHBOARD_CLIENT, first.refresh_token)
    claims = IdTokenVerifier(issuer, (DASHBOARD,)).verify_id_token(second.id_token)
    assert claims.subject == ALICE.sub
    assert second.refresh_token and second.refresh_token != first.refresh_token
    with pytest.raises(SignInFailed, match="invalid_grant"):  # the old one was revoked
        refresh(issuer.discovery(), DASHBOARD_CLIENT, first.refresh_token)


def test_the_device_flow_waits_for_approval_and_slows_down_when_told(start_provider):
    oidc_provider = start_provider(device_interval=2)
    discovery = Issuer(oidc_provider.issuer).discovery()
    device = start_device_flow(discovery, Client(CLI), SCOPES)
    assert (device.interval, device.verification_uri) == (2, f"{oidc_provider.issuer}/device")
    waits = []

    def sleep(seconds):  # no real waiting: the oidc_provider sees each poll come too soon
        waits.append(seconds)
        if len(waits) == 3:
            oidc_provider.approve(device.user_code)

    tokens = poll_device_flow(discovery, Client(CLI), device, sleep=sleep)
    assert waits == [2, 2, 7]  # pending, slow_down (+5 s from then on), approved
    claims = IdTokenVerifier(Issuer(oidc_provider.issuer), (CLI,)).verify_id_token(tokens.id_token)
    assert claims.subject == ALICE.sub


def test_the_device_flow_approved_in_another_thread(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    device = start_device_flow(discovery, Client(CLI), SCOPES)

    def user_at_the_browser():
        httpx.post(device.verification_uri, data={"user_code": device.user_code})

    threading.Thread(target=user_at_the_browser).start()
    tokens = poll_device_flow(discovery, Client(CLI), device, sleep=lambda s: threading.Event().wait(0.01))
    assert tokens.id_token and tokens.refresh_token


def test_an_expired_device_code_ends_the_wait(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    device = start_device_flow(discovery, Client(CLI), SCOPES)
    oidc_provider.expire_device_codes()
    with pytest.raises(SignInFailed, match="expired"):
        poll_device_flow(discovery, Client(CLI), device, sleep=lambda s: None)


def test_a_denied_device_code_ends_the_wait(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    device = start_device_flow(discovery, Client(CLI), SCOPES)
    oidc_provider.approve(device.user_code, approved=False)
    with pytest.raises(SignInFailed, match="denied"):
        poll_device_flow(discovery, Client(CLI), device, sleep=lambda s: None)


def test_the_clients_own_deadline_ends_the_wait(oidc_provider):
    discovery = Issuer(oidc_provider.issuer).discovery()
    device = start_device_flow(discovery, Client(CLI), SCOPES)
    now = iter(range(0, 10**6, 1000))  # each look at the clock: 1000 s later
    with pytest.raises(SignInFailed, match="expired"):
        poll_device_flow(discovery, Client(CLI), device, sleep=lambda s: None, clock=lambda: next(now))
