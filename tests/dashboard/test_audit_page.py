"""The audit page in Chromium against a real server: the admin reads who did what (a key made with a
hostile name shows as text, never as HTML), filters by action, a maintainer reads its project's rows, and
a member has no audit link and is told it may not read them."""

from __future__ import annotations

import httpx
from playwright.sync_api import expect

from tests.helpers.browser import auth, sign_in


def test_the_audit_page_shows_changes_to_an_admin_and_a_maintainer_and_not_to_a_member(
    page, dashboard_server
):
    url, admin = dashboard_server.url, dashboard_server.key
    http = httpx.Client(base_url=url, headers=auth(admin), timeout=30)
    assert http.post("/api/v1/projects", json={"name": "audited"}).status_code == 201
    keys = {}
    for name, role in (("audit-lead", "maintainer"), ("audit-dev", "member")):
        made = http.post("/api/v1/keys", json={"name": name, "project": "audited", "role": role})
        assert made.status_code == 201, made.text
        keys[name] = made.json()["key"]
    assert http.patch("/api/v1/projects/audited", json={"share": 2}).status_code == 200
    # a failed sign-in with a key nobody holds, at a path that looks like HTML: shown as text
    assert httpx.get(f"{url}/api/v1/<b>bold</b>", headers=auth("gf_" + "n" * 40)).status_code == 401
    assert http.post("/api/v1/projects", json={"name": "x-odd"}).status_code == 201

    sign_in(page, url, admin, "/audit")
    rows = page.locator("table#audit tbody tr")
    expect(rows.first).to_contain_text("projects.create")
    expect(page.locator("table#audit")).to_contain_text("share 1 → 2")
    expect(page.locator("table#audit tr.refused").first).to_contain_text("sign_in")
    expect(page.locator("table#audit tr.refused").first).to_contain_text("/api/v1/<b>bold</b>")
    expect(page.locator("table#audit b")).to_have_count(0)
    page.fill("input[name=action]", "keys.create")
    page.click("#audit-filter button[type=submit]")
    expect(page.locator("table#audit tbody tr")).to_have_count(2)
    expect(page.locator("table#audit tbody")).to_contain_text("key audit-dev")
    assert "action=keys.create" in page.url

    page.click("#signout")
    sign_in(page, url, keys["audit-lead"], "/audit")
    expect(page.locator("#nav a[href='/audit']")).to_be_visible()
    expect(page.locator("table#audit tbody")).to_contain_text("project audited")
    expect(page.locator("table#audit tbody")).not_to_contain_text("x-odd")  # another project's row

    page.click("#signout")
    sign_in(page, url, keys["audit-dev"], "/audit")
    expect(page.locator("#nav a[href='/audit']")).to_have_count(0)
    expect(page.locator("p.error")).to_contain_text("a maintainer or more")
