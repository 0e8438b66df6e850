"""scripts/durations.py reads the JUnit XML pytest writes (scripts/test.sh's test-durations.xml): a real
pytest run of two small files, then the summary, slowest file first."""

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)


def test_the_summary_puts_the_slowest_file_and_test_first(tmp_path):
    (tmp_path / "test_quick.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_b():\n    time.sleep(0.3)\n")
    report = tmp_path / "report.xml"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--junitxml={report}", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "durations.py"), str(report), "--top", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[0].startswith("2 tests")
    files = [line.split()[-1] for line in lines[3:5]]
    assert files == ["test_sleepy.py", "test_quick.py"], summary.stdout
    assert lines[-2].split()[-1] == "test_sleepy.py::test_b"
    script = str(ROOT / "scripts" / "durations.py")
    missing = subprocess.run([sys.executable, script, "none.xml"], cwd=tmp_path, capture_output=True)
    assert missing.returncode == 2 and b"no none.xml" in missing.stderr


def test_the_tier_check_names_a_long_test_left_in_the_fast_tier(tmp_path, monkeypatch):
    import importlib.util

    loaded = importlib.util.spec_from_file_location("durations", ROOT / "scripts" / "durations.py")
    durations = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(durations)
    (tmp_path / "test_quick.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_a(n):\n    pass\n"
    )
    (tmp_path / "test_marked.py").write_text("import pytest\n\n@pytest.mark.slow\ndef test_b():\n    pass\n")
    monkeypatch.chdir(tmp_path)  # pytest collects from here
    fast = durations.fast_tier()
    assert fast == {("test_quick.py", "test_a")}
    cases = [
        ("test_quick.py", "test_a[1]", 3.0),
        ("test_quick.py", "test_a[2]", 0.1),
        ("test_marked.py", "test_b", 9.0),
    ]
    assert durations.misplaced(cases, fast) == [("test_quick.py", "test_a[1]", 3.0)]
