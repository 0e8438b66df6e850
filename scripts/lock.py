"""The lock of what scripts/setup.sh installs: one file per Python and platform in locks/, pinning every
package but torch (GPUFORGE_TORCH picks that, and its build differs by machine).

    python scripts/lock.py name            # this interpreter's lock file name
    python scripts/lock.py write VENV      # the lock from what VENV holds (scripts/lock.sh, after a pass)
    python scripts/lock.py diff VENV       # how VENV differs from the lock (.ci/run --latest prints it)
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

LOCKS = Path(__file__).resolve().parents[1] / "locks"
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
# torch comes from GPUFORGE_TORCH (a CPU build here, a CUDA one elsewhere), and these with its CUDA builds;
# nvidia-ml-py (NVML's bindings, hardware/energy_sources.py) is not one of them: locked like any other
NOT_LOCKED = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|pytorch-triton.*)$")


def name() -> str:
    return f"py{sys.version_info[0]}{sys.version_info[1]}-{sys.platform}-{platform.machine().lower()}.txt"


def _normal(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()


def installed(venv: Path) -> dict[str, str]:
    """package -> version of what `venv` holds, gpuforge itself and torch's family left out."""
    frozen = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all", "--exclude-editable"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    pins = {}
    for line in frozen.splitlines():
        if (found := PINNED.match(line.strip())) and not NOT_LOCKED.match(_normal(found.group(1))):
            pins[_normal(found.group(1))] = found.group(2)
    return pins


def locked(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    lines = (PINNED.match(line.strip()) for line in path.read_text().splitlines())
    return {_normal(m.group(1)): m.group(2) for m in lines if m}


def write(venv: Path) -> Path:
    pins = installed(venv)
    torch = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True,
    ).stdout.strip() or "none"  # fmt: skip
    LOCKS.mkdir(exist_ok=True)
    path = LOCKS / name()
    head = [
        f"# What scripts/setup.sh installs on Python {platform.python_version()}, {sys.platform}"
        f" {platform.machine()}: the versions the whole suite passed with",
        f"# (bash scripts/lock.sh, {datetime.now(UTC):%Y-%m-%d}, beside torch {torch}); refresh it so.",
        "# torch is not here: scripts/setup.sh installs GPUFORGE_TORCH first.",
    ]
    path.write_text("\n".join([*head, *(f"{p}=={v}" for p, v in sorted(pins.items()))]) + "\n")
    return path


def diff(venv: Path) -> list[str]:
    old, new = locked(LOCKS / name()), installed(venv)
    lines = [f"{p}: {old[p]} -> {new[p]}" for p in sorted(old.keys() & new.keys()) if old[p] != new[p]]
    lines += [f"{p}: new, {new[p]}" for p in sorted(new.keys() - old.keys())]
    lines += [f"{p}: gone (was {old[p]})" for p in sorted(old.keys() - new.keys())]
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["name"]:
        print(name())
    elif len(argv) == 2 and argv[0] == "write":
        print(f"lock: wrote {write(Path(argv[1]))}")
    elif len(argv) == 2 and argv[0] == "diff":
        changes = diff(Path(argv[1]))
        said = f"{len(changes)} differ" if changes else "the same"
        print(f"lock: {argv[1]} against locks/{name()}: {said}")
        for line in changes:
            print(f"  {line}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
