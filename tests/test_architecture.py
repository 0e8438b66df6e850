"""The layer contracts cover the whole package: a new top-level module or package must be placed in a
layer of pyproject.toml, or `lint-imports` would let it import anything and be imported by anything."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import pytest

import gpuforge

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _contracts() -> list[dict]:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def _layered_names() -> set[str]:
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    return {name.strip() for line in layers["layers"] for name in line.split("|")}


def test_every_top_level_module_sits_in_a_layer():
    top_level = {f"gpuforge.{m.name}" for m in pkgutil.iter_modules(gpuforge.__path__)}
    assert top_level, "gpuforge has no modules?"
    assert top_level - _layered_names() == set(), "place these in the layers of pyproject.toml"
    assert _layered_names() - top_level == set(), "these layers name modules that do not exist"


def test_the_rules_the_design_names_are_contracts():
    forbidden = {
        c["id"]: (c["source_modules"], c["forbidden_modules"])
        for c in _contracts()
        if c["type"] == "forbidden"
    }
    sources, targets = forbidden["serve-not-train"]
    assert sources == ["gpuforge.serve"] and "gpuforge.train" in targets
    sources, targets = forbidden["train-no-service"]
    assert "gpuforge.train" in sources and {"gpuforge.server", "gpuforge.store", "gpuforge.scheduler"} <= set(
        targets
    )
    sources, targets = forbidden["store-below-service"]
    assert sources == ["gpuforge.store"] and {"gpuforge.server", "gpuforge.scheduler"} <= set(targets)
    sources, targets = forbidden["executor-chosen-once"]  # the rest asks the Executor protocol
    assert targets == ["gpuforge.executors"] and {"gpuforge.scheduler", "gpuforge.launch"} <= set(sources)


@pytest.mark.slow
def test_the_server_and_the_cli_start_without_torch():
    """The API process answers from the store: torch (seconds to import, hundreds of MB) stays out of it,
    and out of a CLI verb that only talks to a server. A lazy import moved up a layer shows here."""
    import subprocess
    import sys

    code = (
        "import sys, gpuforge.server.app, gpuforge.cli, gpuforge.artifact.manifest\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_cli_starts_without_pydantic():
    """Every verb, `gpuforge jobs` included, pays for what `import gpuforge.cli` imports: the verbs' flags
    are written out (tests keep them equal to the pydantic models) so that pydantic (~100 ms with the
    settings table) is imported only by the verbs that use it."""
    import subprocess
    import sys

    wanted = "('pydantic', 'sqlalchemy')"
    code = f"import sys, gpuforge.cli\nprint(sorted(m for m in {wanted} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


ARCHITECTURE = PYPROJECT.parent / "docs" / "architecture.md"
SOURCE = PYPROJECT.parent / "src" / "gpuforge"


def _top_level() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(gpuforge.__path__)}


def test_docs_architecture_places_every_top_level_module_in_its_drawing_and_its_table():
    text = ARCHITECTURE.read_text()
    drawing = text.split("```\n", 2)[1]  # the first block: the layers
    table = text.split("## What each package owns", 1)[1].split("\n## ", 1)[0]
    for name in sorted(_top_level()):
        is_package = (SOURCE / name).is_dir()
        assert re.search(rf"(?<![\w/]){re.escape(name)}{'/' if is_package else ''}(?![\w])", drawing), (
            f"docs/architecture.md's drawing lacks {name}"
        )
        if name != "__main__":
            shown = f"`{name}/`" if is_package else f"`{name}.py`"
            assert shown in table, f"docs/architecture.md's table lacks {shown}"


def test_every_module_docs_architecture_names_exists():
    """A `path.py` the page names is a file of the project: from its root, from src/gpuforge, or (named
    in a package's row) within that package."""
    files = [p.relative_to(SOURCE).as_posix() for p in SOURCE.rglob("*.py")]
    missing = []
    for named in sorted(set(re.findall(r"`([\w/.]+\.py)`", ARCHITECTURE.read_text()))):
        if (PYPROJECT.parent / named).is_file() or (SOURCE / named).is_file():
            continue
        if not any(f == named or f.endswith(f"/{named}") for f in files):
            missing.append(named)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
