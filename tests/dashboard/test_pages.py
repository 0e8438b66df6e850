"""The pages as shipped: every static file travels in the wheel, and nothing is loaded from elsewhere or
run inline (the server's Content-Security-Policy would refuse it, and a GPU server is often offline)."""

import re
from fnmatch import fnmatch

import tomllib

from gpuforge.dashboard.pages import SECURITY_HEADERS, STATIC
from tests.helpers.paths import ROOT


def test_every_static_file_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["gpuforge.dashboard"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert "static/index.html" in files and "static/vendor/uPlot.iife.min.js" in files
    assert [f for f in files if not any(fnmatch(f, pattern) for pattern in patterns)] == []


def test_nothing_is_fetched_from_elsewhere_nor_run_inline():
    shell = (STATIC / "index.html").read_text()
    assert re.findall(r'(?:src|href)="([^"]+)"', shell) and all(
        url.startswith(("/static/", "/auth/oidc/")) or url == "/"
        for url in re.findall(r'(?:src|href)="([^"]+)"', shell)
    )
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", shell)  # no inline script
    assert " style=" not in shell and "<style" not in shell
    for path in STATIC.glob("*.js"):
        code = path.read_text()
        # no absolute URL in the modules; SVG's namespace is a name, never fetched
        assert not re.search(r"""["'`]https?://(?!www\.w3\.org/2000/svg["'`])""", code), path.name
        assert ".innerHTML" not in code and "insertAdjacentHTML" not in code, path.name  # text as text
    assert "default-src 'self'" in SECURITY_HEADERS["Content-Security-Policy"]
