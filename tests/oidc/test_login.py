"""`gpuforge login` against a real provider and a server's /auth/oidc/config: the device flow (approved
at the provider by another thread, as the user in a browser), the loopback redirect, the kept 0600 file,
and the client presenting (and refreshing) the ID token."""

import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import SecretStr

from gpuforge.client import Client
from gpuforge.errors import GpuforgeError
from gpuforge.oidc.flows import SignInFailed
from gpuforge.oidc.login import can_open_browser, printable, sign_in
from gpuforge.oidc.login_file import StoredLogin, load_login, login_path, save_login
from gpuforge.oidc.loopback import LoopbackReceiver
from gpuforge.oidc.session import SignedIn
from gpuforge.server.oidc import OidcSettings, OidcSignIn
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, SECRET, serving

DEADLINE_S = 60  # for a thread or a process to do what it must: far beyond what it takes


@contextmanager
def gpuforge_server(provider):
    """The SSO routes, and /api/v1/jobs answering who the bearer ID token says the caller is."""
    sso = OidcSignIn(OidcSettings(provider.issuer, DASHBOARD, SecretStr(SECRET), CLI), lambda *a: None)
    app = FastAPI()
    app.include_router(sso.router())
    seen = []

    @app.get("/api/v1/jobs")
    def jobs(request: Request):
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        try:
            claims = sso.verify_bearer(token)
        except GpuforgeError as err:
            return JSONResponse({"detail": str(err)}, 401)
        seen.append(token)
        return [{"id": 1, "name": claims.subject}]

    with serving(app, "gpuforge-server") as url:
        yield url, seen


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "gpuforge"


def approve_when_asked(provider) -> threading.Thread:
    """The user: once the CLI has a user code, types it at the provider's /device page."""

    def user():
        assert provider.device_code_issued.wait(DEADLINE_S)
        (code,) = [c["user_code"] for c in provider.device_codes.values()]
        httpx.post(f"{provider.issuer}/device", data={"user_code": code}).raise_for_status()

    thread = threading.Thread(target=user, daemon=True)
    thread.start()
    return thread


def test_login_with_the_device_flow_keeps_a_0600_sign_in(oidc_provider, config_home):
    shown = []
    with gpuforge_server(oidc_provider) as (url, _):
        approve_when_asked(oidc_provider)
        login = sign_in(
            url, show=shown.append, open_browser=False, sleep=lambda s: threading.Event().wait(0.01)
        )
    assert any(f"{oidc_provider.issuer}/device" in line for line in shown)
    assert shown[-1] == f"signed in to {url} as {ALICE.email}"
    path = login_path(url)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    kept = load_login(url)
    assert kept.id_token == login.id_token and kept.refresh_token and kept.issuer == oidc_provider.issuer


class Browser:
    """The user's browser: opens the URL `gpuforge login` prints and follows the redirects."""

    def __init__(self):
        self.answer, self.thread = None, None

    def show(self, text: str) -> None:
        if "\nhttp" in text:  # the authorization URL, on a line of its own
            url = text.rsplit("\n", 1)[1]
            self.thread = threading.Thread(target=self._open, args=(url,), daemon=True)
            self.thread.start()

    def _open(self, url: str) -> None:
        self.answer = httpx.get(url, follow_redirects=True, timeout=DEADLINE_S)


def test_login_through_a_browser_where_the_provider_has_no_device_flow(start_provider, config_home):
    provider = start_provider(device_flow=False)
    browser = Browser()
    with gpuforge_server(provider) as (url, _):
        login = sign_in(url, show=browser.show, open_browser=False)
    browser.thread.join(DEADLINE_S)
    assert browser.answer.status_code == 200 and "Signed in" in browser.answer.text
    assert load_login(url).id_token == login.id_token


def test_browser_is_asked_for_even_with_a_device_flow(oidc_provider, config_home):
    browser = Browser()
    with gpuforge_server(oidc_provider) as (url, _):
        sign_in(url, show=browser.show, use_browser=True, open_browser=False)
    assert oidc_provider.device_codes == {}


def test_the_loopback_receiver_ignores_a_request_without_the_state():
    with LoopbackReceiver() as receiver:
        answers = []

        def others_then_the_provider():
            answers.append(httpx.get(receiver.redirect_uri, params={"code": "stolen", "state": "guess"}))
            answers.append(httpx.get(receiver.redirect_uri, params={"code": "real", "state": "the-state"}))

        thread = threading.Thread(target=others_then_the_provider, daemon=True)
        thread.start()
        assert receiver.wait("the-state", DEADLINE_S) == "real"
        thread.join(DEADLINE_S)
    assert [a.status_code for a in answers] == [400, 200]


def test_the_loopback_receiver_gives_the_providers_refusal():
    with LoopbackReceiver() as receiver:
        threading.Thread(
            target=httpx.get, args=(receiver.redirect_uri,),
            kwargs={"params": {"error": "access_denied", "state": "s"}}, daemon=True,
        ).start()  # fmt: skip
        with pytest.raises(SignInFailed, match="access_denied"):
            receiver.wait("s", DEADLINE_S)


def test_a_sign_in_file_others_may_read_is_refused(config_home):
    login = StoredLogin("http://gpu.example:8600", "https://sso.example", CLI, "a.b.c", "r", 0)
    path = save_login(login)
    path.chmod(0o644)
    with pytest.raises(GpuforgeError, match="others may read"):
        load_login("http://gpu.example:8600")


def test_a_sign_in_is_filed_by_server(config_home):
    save_login(StoredLogin("http://gpu.example:8600/", "https://sso.example", CLI, "a.b.c", "r", 0))
    assert load_login("HTTP://GPU.example:8600").id_token == "a.b.c"
    assert load_login("http://other.example:8600") is None
    assert "a.b.c" not in repr(load_login("http://gpu.example:8600"))


def test_the_client_presents_the_id_token_and_refreshes_it_near_expiry(start_provider, config_home):
    provider = start_provider(id_token_ttl_s=30)  # within REFRESH_BEFORE_S: refreshed at the first request
    with gpuforge_server(provider) as (url, seen):
        approve_when_asked(provider)
        first = sign_in(url, show=lambda _: None, sleep=lambda s: threading.Event().wait(0.01))
        assert Client(url).jobs() == [{"id": 1, "name": ALICE.sub}]
    kept = load_login(url)
    assert seen == [kept.id_token] and kept.id_token != first.id_token
    assert kept.refresh_token != first.refresh_token  # the provider rotated it; the new one is kept


def test_a_refresh_the_provider_refuses_says_to_sign_in_again(oidc_provider, config_home):
    token = oidc_provider.mint(audience=CLI)
    login = StoredLogin("http://gpu.example:8600", oidc_provider.issuer, CLI, token, "revoked-or-unknown", 0)
    with pytest.raises(GpuforgeError, match="gpuforge login"):
        SignedIn(login).current_token()


def test_a_fresh_id_token_is_sent_as_it_is(oidc_provider, config_home):
    token = oidc_provider.mint(audience=CLI)
    login = StoredLogin("http://gpu.example:8600", oidc_provider.issuer, CLI, token, None, 2**40)
    assert SignedIn(login).current_token() == token
    assert oidc_provider.token_requests == 0


def test_gpuforge_login_and_logout_as_a_user_runs_them(oidc_provider, tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "COLUMNS": "200"}
    with gpuforge_server(oidc_provider) as (url, _):
        approver = approve_when_asked(oidc_provider)
        done = subprocess.run([sys.executable, "-m", "gpuforge", "login", "--server", url], env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
        approver.join(DEADLINE_S)
    assert done.returncode == 0, done.stderr
    assert "enter the code" in done.stderr and f"signed in to {url}" in done.stderr
    path = login_path(url, tmp_path / "config" / "gpuforge")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    out = subprocess.run([sys.executable, "-m", "gpuforge", "logout", "--server", url], env=env,
                         capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    assert out.returncode == 0 and "signed out" in out.stderr and not path.exists()


def test_a_providers_text_reaches_the_terminal_without_escapes():
    assert printable("ABCD-\x1b[2J\x07EFGH\n") == "ABCD-[2JEFGH"


def test_no_browser_is_started_on_linux_without_a_display(monkeypatch):
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert not can_open_browser()
    monkeypatch.setenv("DISPLAY", ":0")
    assert can_open_browser()


def test_a_sign_in_file_that_holds_something_else_is_refused(config_home):
    path = save_login(StoredLogin("http://gpu.example:8600", "https://sso.example", CLI, "a.b.c", "r", 0))
    path.write_text('{"server": "http://gpu.example:8600", "issuer": 1, "client_id": "c", "id_token": "t", '
                    '"refresh_token": null, "expires_at": 0}')  # fmt: skip
    with pytest.raises(GpuforgeError, match="not a gpuforge sign-in"):
        load_login("http://gpu.example:8600")
