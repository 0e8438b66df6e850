"""The server's single sign-on (server/oidc.py) against a real provider: its settings, the dashboard's
code flow through /auth/oidc/start and /auth/oidc/callback as a browser follows it, and a CLI's bearer."""

from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import SecretStr

from gpuforge.child_env import child_environment
from gpuforge.errors import GpuforgeError
from gpuforge.oidc.verify import TokenRefused
from gpuforge.server.oidc import STATE_COOKIE, OidcSettings, OidcSignIn, local_path, oidc_settings
from gpuforge.server.settings import Settings
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, SECRET, serving

SCOPES = ("openid", "profile", "email", "groups")


def signed_in(request, claims, next_path):
    """The integrator's part, here: answer with what the sign-in gave."""
    return JSONResponse({"sub": claims.subject, "email": claims.email, "groups": list(claims.groups),
                         "next": next_path})  # fmt: skip


def sso_for(provider, secret: str = SECRET) -> OidcSignIn:
    settings = OidcSettings(provider.issuer, DASHBOARD, SecretStr(secret), CLI, SCOPES)
    return OidcSignIn(settings, signed_in)


@contextmanager
def dashboard(provider, secret: str = SECRET):
    """The routes served on loopback, registered at the provider with their callback URL."""
    sso = sso_for(provider, secret)
    app = FastAPI()
    app.include_router(sso.router())
    with serving(app, "gpuforge-server") as url:
        provider.register_client(DASHBOARD, secret=SECRET, redirect_uris=[f"{url}/auth/oidc/callback"])
        yield url, sso


def test_config_tells_the_cli_how_to_sign_in(oidc_provider):
    with dashboard(oidc_provider) as (url, _):
        config = httpx.get(f"{url}/auth/oidc/config").json()
    assert config == {
        "issuer": oidc_provider.issuer,
        "client_id": CLI,
        "scopes": list(SCOPES),
        "device_flow": True,
    }


def test_a_browser_signs_in_through_the_provider(oidc_provider):
    with dashboard(oidc_provider) as (url, _), httpx.Client(follow_redirects=True) as browser:
        answer = browser.get(f"{url}/auth/oidc/start", params={"next": "/jobs/3"})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "sub": ALICE.sub,
            "email": ALICE.email,
            "groups": list(ALICE.groups),
            "next": "/jobs/3",
        }
        hops = [str(r.url).split("?")[0] for r in answer.history]
        assert hops == [f"{url}/auth/oidc/start", f"{oidc_provider.issuer}/authorize"]
        assert STATE_COOKIE not in browser.cookies  # the sign-in's state is spent


def test_the_state_cookie_is_httponly_lax_and_scoped(oidc_provider):
    with dashboard(oidc_provider) as (url, _):
        cookie = httpx.get(f"{url}/auth/oidc/start").headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/auth/oidc" in cookie


def to_the_callback(url: str) -> tuple[httpx.Client, str]:
    """A browser that started a sign-in, and the callback URL the provider sent it to (not yet followed)."""
    browser = httpx.Client()
    provider_url = browser.get(f"{url}/auth/oidc/start").headers["location"]
    return browser, browser.get(provider_url).headers["location"]


def test_a_callback_in_another_browser_does_not_sign_in(oidc_provider):
    with dashboard(oidc_provider) as (url, _):
        victim_browser = httpx.Client()  # login CSRF: the attacker's callback URL, the victim's browser
        _, callback = to_the_callback(url)
        answer = victim_browser.get(callback)
    assert answer.status_code == 400 and "not started in this browser" in answer.json()["detail"]


def test_a_callback_is_accepted_once(oidc_provider):
    with dashboard(oidc_provider) as (url, _):
        browser, callback = to_the_callback(url)
        assert browser.get(callback).status_code == 200
        browser.cookies.set(STATE_COOKIE, httpx.URL(callback).params["state"], path="/auth/oidc")
        again = browser.get(callback)
    assert again.status_code == 400 and "finished already" in again.json()["detail"]


def test_the_providers_refusal_is_a_401(oidc_provider):
    with dashboard(oidc_provider) as (url, _):
        browser, callback = to_the_callback(url)
        state = httpx.URL(callback).params["state"]
        answer = browser.get(f"{url}/auth/oidc/callback", params={"state": state, "error": "access_denied"})
    assert answer.status_code == 401 and "access_denied" in answer.json()["detail"]


def test_a_wrong_client_secret_fails_the_sign_in_without_showing_it(oidc_provider):
    with (
        dashboard(oidc_provider, secret="not-the-secret") as (url, _),
        httpx.Client(follow_redirects=True) as b,
    ):
        answer = b.get(f"{url}/auth/oidc/start")
    assert answer.status_code == 401 and "invalid_client" in answer.json()["detail"]
    assert "not-the-secret" not in answer.text


@pytest.mark.parametrize(
    "asked", ["//evil.example/x", "https://evil.example", "/\\evil.example", "/\t/evil", "jobs"]
)
def test_after_sign_in_only_a_local_path(asked):
    assert local_path(asked) == "/"
    assert local_path("/jobs/3?tab=logs") == "/jobs/3?tab=logs"


def test_a_clis_bearer_id_token_is_verified(oidc_provider):
    sso = sso_for(oidc_provider)
    assert sso.verify_bearer(oidc_provider.mint(audience=CLI)).subject == ALICE.sub
    assert sso.verify_bearer(oidc_provider.mint(audience=DASHBOARD)).subject == ALICE.sub
    with pytest.raises(TokenRefused, match="audience"):
        sso.verify_bearer(oidc_provider.mint(audience="another-app"))


# --- settings ---
def settings(tmp_path, **given) -> Settings:
    return Settings(home=tmp_path / "home", **given)


def test_no_issuer_is_no_single_sign_on(tmp_path):
    assert oidc_settings(settings(tmp_path)) is None


def test_an_issuer_needs_a_client_id(tmp_path):
    with pytest.raises(GpuforgeError, match="needs both"):
        oidc_settings(settings(tmp_path, oidc_issuer="https://sso.example.com"))


def test_the_secret_comes_from_its_file_and_is_never_shown(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-file\n")
    config = oidc_settings(settings(tmp_path, oidc_issuer="https://sso.example.com", oidc_client_id="gf",
                                    oidc_client_secret_file=secret_file))  # fmt: skip
    assert config.client_secret.get_secret_value() == "from-the-file"
    assert config.cli_client_id == "gf" and config.scopes == ("openid", "profile", "email")
    assert "from-the-file" not in repr(config)


def test_the_secret_from_the_environment_and_a_file_at_once_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFORGE_OIDC_CLIENT_SECRET", "from-the-env")
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-file\n")
    given = settings(tmp_path, oidc_issuer="https://sso.example.com", oidc_client_id="gf")
    assert oidc_settings(given).client_secret.get_secret_value() == "from-the-env"
    given = settings(tmp_path, oidc_issuer="https://sso.example.com", oidc_client_id="gf",
                     oidc_client_secret_file=secret_file)  # fmt: skip
    with pytest.raises(GpuforgeError, match="one of them"):
        oidc_settings(given)


def test_a_plain_http_issuer_off_loopback_is_refused(tmp_path):
    with pytest.raises(GpuforgeError, match="https"):
        oidc_settings(settings(tmp_path, oidc_issuer="http://sso.example.com", oidc_client_id="gf"))


def test_a_child_never_gets_the_client_secret():
    base = {"GPUFORGE_OIDC_CLIENT_SECRET": "s", "GPUFORGE_OIDC_CLIENT_SECRET_FILE": "/f", "PATH": "/bin"}
    assert child_environment(base=base) == {"PATH": "/bin"}
