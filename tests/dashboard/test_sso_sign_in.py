"""The dashboard's single sign-on in Chromium against a real server and a real OpenID provider on
loopback: "Sign in with <issuer>" beside the key form, through the provider and back, signed in as the
person with the project and role their groups give, the one-time code gone from the address bar."""

from __future__ import annotations

import httpx
from playwright.sync_api import expect

from gpuforge.server.local import LocalServer
from tests.helpers.browser import auth, wait_signed_in
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, SECRET


def test_a_person_signs_in_to_the_dashboard_through_the_provider(page, tmp_path, oidc_provider):
    env = {"GPUFORGE_SCHEDULE": "false", "GPUFORGE_OIDC_ISSUER": oidc_provider.issuer,
           "GPUFORGE_OIDC_CLIENT_ID": DASHBOARD, "GPUFORGE_OIDC_CLI_CLIENT_ID": CLI,
           "GPUFORGE_OIDC_CLIENT_SECRET": SECRET, "GPUFORGE_OIDC_ROLES": "ml-team=vision:member",
           "GPUFORGE_OIDC_SCOPES": "openid profile email groups"}  # fmt: skip
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", **env) as live:
        oidc_provider.register_client(
            DASHBOARD, secret=SECRET, redirect_uris=[f"{live.url}/auth/oidc/callback"]
        )
        made = httpx.post(f"{live.url}/api/v1/projects", json={"name": "vision"}, headers=auth(live.key))
        assert made.status_code == 201, made.text
        page.goto(f"{live.url}/costs")
        link = page.locator("#sso-start")
        expect(link).to_have_text(f"Sign in with {oidc_provider.issuer.removeprefix('http://')}")
        link.click()
        wait_signed_in(page)
        expect(page.locator("#whoami")).to_have_text(f"{ALICE.email} (member in vision)")
        assert page.url.startswith(f"{live.url}/costs") and "sso=" not in page.url  # back, the code gone
        expect(page.locator("#page h1")).to_have_text("Costs")
        page.reload()  # the session's key is the tab's, as a typed key is
        wait_signed_in(page)
        expect(page.locator("#whoami")).to_contain_text(ALICE.email)
