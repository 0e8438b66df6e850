"""The dashboard's browser tests: one Chromium and one gpuforge server a module, one page (in a
context of its own) a test; a failed test leaves `failure.png`, the page as it was, in its tmp_path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuforge.server.local import LocalServer
from tests.helpers.browser import launch, new_page, require_browser
from tests.helpers.paths import TEST_MODELS


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """Chromium for one module's tests. Not for the session: Playwright's sync API runs an event loop in
    this thread while it is started, and every later test that calls asyncio.run would fail."""
    require_browser()
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    try:
        chromium = launch(playwright)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()


@pytest.fixture(scope="module")
def dashboard_server(tmp_path_factory) -> Iterator[LocalServer]:
    """A real server on loopback that runs jobs (one CPU slot), for every test of a module. Any key may
    submit the tests' python: model (tests/assets is a data root, and user code is allowed)."""
    require_browser()  # no server started for tests that will be skipped
    where = tmp_path_factory.mktemp("dashboard-server")
    data = where / "data"
    data.mkdir()
    server = LocalServer(
        where / "home",
        log=where / "server.log",
        GPUFORGE_DATA_ROOTS=os.pathsep.join([str(data), str(TEST_MODELS.parent)]),
        GPUFORGE_ALLOW_USER_CODE="true",
        GPUFORGE_CPU_SLOTS="1",
    )
    server.data = data  # files a spec may name
    with server:
        yield server


@pytest.fixture
def page(browser, tmp_path, request) -> Iterator:
    """A fresh page at 1280x800; what its console said and the errors it threw are kept for a failure."""
    page = new_page(browser)
    page.set_default_timeout(15_000)
    said: list[str] = []

    def console(message) -> None:
        if message.type in ("error", "warning"):
            said.append(f"console.{message.type}: {message.text}")

    page.on("console", console)
    page.on("pageerror", lambda e: said.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: said.append(f"request failed: {r.method} {r.url} {r.failure}"))
    request.node.dashboard_page = (page, tmp_path, said)
    try:
        yield page
    finally:
        del request.node.dashboard_page
        page.context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A browser test that failed: a screenshot of its page, `failure.png` in its tmp_path, named in the
    report beside what the page's console said and the end of the server's log."""
    outcome = yield
    report = outcome.get_result()
    if not (report.failed and report.when in ("setup", "call")):
        return
    if kept := getattr(item, "dashboard_page", None):
        page, tmp_path, said = kept
        shot = Path(tmp_path) / "failure.png"
        try:
            page.screenshot(path=str(shot), full_page=True)
            where = f"{shot} (at {page.url})"
        except Exception as e:  # a page that crashed: say so, keep the test's own failure
            where = f"no screenshot: {e}"
        report.sections.append(("dashboard page", "\n".join([f"screenshot: {where}", *said[-30:]])))
    server = getattr(item, "funcargs", {}).get("dashboard_server")
    if server is not None and server.log_path and server.log_path.exists():
        tail = server.log_path.read_text(errors="replace").splitlines()[-40:]
        report.sections.append((f"server log ({server.log_path}), its end", "\n".join(tail)))
