"""No module outside the executors names an executor kind: the kind is read once (executors.build) and
everything else asks the Executor protocol (scheduler/executor.py). Adding an executor is then one module
of gpuforge/executors/ and a line of build, not a hunt through the packages that used to compare strings."""

from __future__ import annotations

import re
from pathlib import Path

import gpuforge

SOURCE = Path(gpuforge.__file__).parent
NAMES_A_KIND = re.compile(
    r"""["'](slurm|ray)["']"""  # a kind as a quoted string
    r"""|\bexecutor\b\)?\s*(==|!=|\bin\b)"""  # a comparison: executor == ..., executor in (...)
    r"""|env_name\(\s*["']executor["']\s*\)"""  # the setting's variable read raw, to compare it
)
# Where a kind may be named, and why.
ALLOWED = {
    "settings.py": "the one definition of the option: its Literal of the kinds",
    "executors/": "the implementations, and build(), which picks one from the setting",
    "launch/": "what the implementations run (rank launchers on Ray, Slurm), addressed by their own terms",
}


def _allowed(path: str) -> bool:
    return any(path == name or (name.endswith("/") and path.startswith(name)) for name in ALLOWED)


def test_no_module_outside_the_executors_names_an_executor_kind():
    found = []
    for file in sorted(SOURCE.rglob("*.py")):
        path = file.relative_to(SOURCE).as_posix()
        if _allowed(path):
            continue
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if NAMES_A_KIND.search(line):
                found.append(f"src/gpuforge/{path}:{number}: {line.strip()}")
    assert not found, "ask the Executor (scheduler/executor.py) instead:\n" + "\n".join(found)


def test_the_check_sees_the_comparisons_it_replaced():
    """What server/app.py, scheduler/loop.py and cli/local.py said before the executors: each is caught."""
    before = [
        'if settings.executor == "slurm":',
        "if settings.executor != 'ray':",
        'environment().executor in ("ray", "slurm")',
        'self.runner_env.get(env_name("executor")) == "slurm"',
    ]
    assert [line for line in before if not NAMES_A_KIND.search(line)] == []
    assert not NAMES_A_KIND.search("self.executor.launches_ranks")  # asking the executor is fine
    assert not NAMES_A_KIND.search('return {"name": "local", "admin": True}')  # a word, not a kind


def test_each_allowed_place_exists():
    for name in ALLOWED:
        assert (SOURCE / name).exists(), f"{name} is allowed but there is no such module"
