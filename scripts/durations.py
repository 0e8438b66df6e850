"""Where the test suite's time goes, from the JUnit XML scripts/test.sh leaves (test-durations.xml): the
files by their tests' summed time, slowest first, and the slowest tests.

    python scripts/durations.py [test-durations.xml] [--top N]
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default="test-durations.xml", type=Path)
    parser.add_argument("--top", type=int, default=25)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
