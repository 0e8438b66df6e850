"""A real browser for the dashboard's tests: Debian's Chromium (scripts/browser.sh installs it) driven
headless through Playwright's sync API, and the API calls those tests make beside it (keys, jobs).

Playwright's own browser download (`playwright install`) is never used: /usr/bin/chromium is launched.
Without Chromium or the playwright package the browser tests are skipped, or fail where CI or
GPUFORGE_REQUIRE_BROWSER=1 says they must run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpuforge.runtime.host import free_port
from gpuforge.server.local import stop_process

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 800}
NOT_ACCEPTED = "key not accepted"  # what the sign-in page shows for a refused key (docs/dashboard.md)
POLL_S = 2.0  # the pages poll every 2 s: a change shows within about two polls


# --- the browser -----------------------------------------------------------------------------------
def browser_required() -> bool:
    """Whether this run must test in a browser (CI, or GPUFORGE_REQUIRE_BROWSER=1) rather than skip."""
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("GPUFORGE_REQUIRE_BROWSER") == "1" or ci not in ("", "0", "false", "no")


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing (bash scripts/browser.sh installs it)"
    return None


def require_browser() -> None:
    """Skip the calling test (or fail it where a browser is required) when no browser can run."""
    if reason := browser_missing():
        if browser_required():
            pytest.fail(f"{reason}, and CI or GPUFORGE_REQUIRE_BROWSER=1 requires a browser", pytrace=False)
        pytest.skip(reason)


def launch(playwright) -> Any:
    """Chromium, headless; --no-sandbox because the tests run as root, where its sandbox refuses to start."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium for a script (the tests use the fixtures in tests/dashboard/conftest.py)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser, **context: Any) -> Any:
    """A page in a context of its own: its own sessionStorage, so no key carries over from another page."""
    return browser.new_context(viewport=VIEWPORT, **context).new_page()


def submit_form(page, form: str) -> None:
    """Submit `form` as a person would: click its submit button, else Enter in its first input."""
    button = page.locator(f"{form} [type=submit]")
    if button.count():
        button.first.click()
    else:
        page.locator(f"{form} input, {form} textarea").first.press("Enter")


def sign_in(page, url: str, key: str, path: str = "/", wait: bool = True) -> None:
    """Open `path`, type `key` in the sign-in form and send it; with `wait`, until #whoami names the key."""
    page.goto(url + path)
    page.locator("form#signin input[name=api_key]").fill(key)
    submit_form(page, "form#signin")
    if wait:
        wait_signed_in(page)


def wait_signed_in(page, timeout_s: float = 15) -> None:
    page.wait_for_function(
        "() => { const w = document.querySelector('#whoami');"
        " return w && w.offsetParent !== null && w.textContent.trim() !== ''; }",
        timeout=timeout_s * 1000,
    )


def points(page, metric: str = "loss") -> int:
    """The data-points of the page's chart of `metric` (0 while there is none)."""
    chart = page.locator(f".chart[data-metric={metric}]")
    if not chart.count():
        return 0
    return int(chart.first.get_attribute("data-points") or 0)


def wait_for(check: Callable[[], Any], timeout_s: float = 60, every_s: float = 0.25, what: str = "") -> Any:
    """The first truthy answer of `check`, polled; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if found := check():
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or check}")
        time.sleep(every_s)


# --- the API beside it ---------------------------------------------------------------------------
def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make_key(url: str, admin_key: str, name: str) -> str:
    """A new (not admin) key named `name`, made by the admin: its secret."""
    made = httpx.post(f"{url}/api/v1/keys", json={"name": name}, headers=auth(admin_key), timeout=30)
    assert made.status_code == 201, made.text
    return made.json()["key"]


def revoke_key(url: str, admin_key: str, name: str) -> None:
    revoked = httpx.delete(f"{url}/api/v1/keys/{name}", headers=auth(admin_key), timeout=30)
    assert revoked.status_code == 200, revoked.text


def submit(url: str, key: str, spec: dict | str) -> dict:
    """POST /api/v1/jobs: the job as the server answers it (201 asserted)."""
    text = spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False)
    created = httpx.post(f"{url}/api/v1/jobs", json={"spec": text}, headers=auth(key), timeout=30)
    assert created.status_code == 201, created.text
    return created.json()


def job(url: str, key: str, job_id: int) -> dict:
    got = httpx.get(f"{url}/api/v1/jobs/{job_id}", headers=auth(key), timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


def cancel(url: str, key: str, job_id: int) -> dict:
    return httpx.post(f"{url}/api/v1/jobs/{job_id}/cancel", headers=auth(key), timeout=30).json()


def wait_state(url: str, key: str, job_id: int, states: tuple = ("finished",), timeout_s: float = 180):
    """The job once its state is one of `states`; fails at once if it ends in another."""
    ended = ("finished", "failed", "cancelled", "paused")

    def state():
        found = job(url, key, job_id)
        if found["state"] in states:
            return found
        assert found["state"] not in ended, f"job {job_id} ended {found['state']}: {found.get('reason')}"
        return None

    return wait_for(state, timeout_s, what=f"job {job_id} in {states}")


def job_ids(url: str, key: str) -> list[int]:
    listed = httpx.get(f"{url}/api/v1/jobs", params={"limit": 1000}, headers=auth(key), timeout=30)
    assert listed.status_code == 200, listed.text
    return [j["id"] for j in listed.json()]


# --- `gpuforge dashboard RUNS_DIR` ---------------------------------------------------------------
def start_local_dashboard(
    runs_dir: Path, log: Path, timeout_s: float = 60
) -> tuple[subprocess.Popen, str, str]:
    """`gpuforge dashboard RUNS_DIR` as a process on a free loopback port, answering, and the key it
    printed; the caller stops it."""
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuforge", "dashboard", str(runs_dir), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def answers():
        assert process.poll() is None, f"gpuforge dashboard exited {process.returncode}: {log.read_text()}"
        try:
            return httpx.get(f"{url}/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, timeout_s, every_s=0.1, what="gpuforge dashboard to answer /")
        key = re.search(r"sign in with the key (gfd_\S+)", log.read_text())
        assert key, f"gpuforge dashboard printed no key: {log.read_text()}"
    except BaseException:
        stop(process)
        raise
    return process, url, key.group(1)


stop = stop_process  # the tests' name for it


def text_of(page, selector: str) -> str:
    """The visible text of the first element `selector` matches, whitespace squeezed ('' if none)."""
    found = page.locator(selector)
    return re.sub(r"\s+", " ", found.first.inner_text()).strip() if found.count() else ""
