"""Where the test suite's time goes, from the JUnit XML scripts/test.sh leaves (test-durations.xml): the
files by their tests' summed time, slowest first, and the slowest tests.

    python scripts/durations.py [test-durations.xml] [--top N] [--tier]

--tier: also the tests of the fast tier (not marked slow: docs/testing.md) that took SLOW_S or more in
that report, which belong in the slow tier (pytest is asked which tests the fast tier holds).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[tuple[str, str, float]]:
    """(file, test, seconds) of each test case the report holds (setup and teardown included)."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        file = module.replace(".", "/") + ".py" if module else "?"
        cases.append((file, case.get("name", "?"), float(case.get("time") or 0.0)))
    return cases


SLOW_S = 2.0  # a test this long or longer is marked slow (docs/testing.md)


def fast_tier() -> set[tuple[str, str]]:
    """(file, test function) of each test `pytest -m "not slow"` would run."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    split = (line.partition("::") for line in listed.splitlines())
    return {(file, _function(name)) for file, _, name in split if name}


def _function(name: str) -> str:
    return re.sub(r"\[.*$", "", name)  # a parametrized case's function


Case = tuple[str, str, float]


def misplaced(cases: list[Case], fast: set[tuple[str, str]]) -> list[Case]:
    """The cases of the fast tier that took SLOW_S or more."""
    return [(f, n, s) for f, n, s in cases if s >= SLOW_S and (f, _function(n)) in fast]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default="test-durations.xml", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tier", action="store_true", help="fast-tier tests that belong in the slow tier")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"durations: no {args.report} (scripts/test.sh writes it)", file=sys.stderr)
        return 2
    cases = read(args.report)
    per_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds in cases:
        per_file[file].append(seconds)
    total = sum(s for _, _, s in cases)
    print(f"{len(cases)} tests, {total / 60:.1f} min of test time in all (two workers share it)\n")
    print(f"{'seconds':>8} {'tests':>5}  file")
    for file, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"{sum(times):8.1f} {len(times):5d}  {file}")
    print(f"\n{'seconds':>8}  slowest tests")
    for file, name, seconds in sorted(cases, key=lambda c: -c[2])[: args.top]:
        print(f"{seconds:8.1f}  {file}::{name}")
    if args.tier:
        slow_here = misplaced(cases, fast_tier())
        print(f"\n{len(slow_here)} fast-tier test(s) took {SLOW_S:g} s or more: mark them @pytest.mark.slow")
        for file, name, seconds in sorted(slow_here, key=lambda c: -c[2]):
            print(f"{seconds:8.1f}  {file}::{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
