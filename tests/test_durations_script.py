"""scripts/durations.py reads the JUnit XML pytest writes (scripts/test.sh's test-durations.xml): a real
pytest run of two small files, then the summary, slowest file first."""

import subprocess
import sys

from tests.helpers.paths import ROOT


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
