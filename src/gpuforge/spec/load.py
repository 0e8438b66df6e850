"""Reading a spec: the YAML file, the overrides, the paths resolved, and every problem one SpecError."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpuforge.errors import SpecError
from gpuforge.spec.jobs import JobSpec, ScriptJobSpec
from gpuforge.spec.overrides import apply_override
from gpuforge.spec.paths import resolve_paths
from gpuforge.spec.problems import format_validation_error


def parse_spec(
    raw: Any, base_dir: Path, overrides: list[str] = (), default_name: str = "job", origin: str | None = None
) -> JobSpec | ScriptJobSpec:
    """Validate a raw (YAML-decoded) spec, after overrides, with paths resolved against base_dir. A problem
    is blamed on the `--set` that made it, else on `origin` (the spec file's name) where given."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        where = f"{origin}: " if origin else ""
        raise SpecError(
            f"{where}the spec must be a mapping of sections (model, data, train, ...), "
            f"got {type(raw).__name__}"
        )
    if "tune" in raw:
        where = f"{origin}: " if origin else ""
        raise SpecError(
            f"{where}tune: is a search's section: `gpuforge tune SPEC` runs the search; "
            "this verb takes one job"
        )
    for assignment in overrides:
        apply_override(raw, assignment)
    raw.setdefault("name", default_name)
    resolve_paths(raw, base_dir)
    try:
        if raw.get("kind") == "script":
            if isinstance(raw.get("script"), dict):
                raw["script"].setdefault("workdir", str(base_dir.resolve()))
            return ScriptJobSpec.model_validate(raw)
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, overrides, origin)) from None


def load_train_spec(path: str | Path, overrides: list[str], verb: str) -> JobSpec:
    """load_spec for a verb that works on gpuforge's engine: a script job is refused, saying why."""
    spec = load_spec(path, overrides)
    if spec.kind == "script":
        raise SpecError(
            f"{path}: kind: script: {verb} is for jobs gpuforge trains (a script runs its own code)"
        )
    return spec


def load_spec(path: str | Path, overrides: list[str] = ()) -> JobSpec | ScriptJobSpec:
    """Read a spec file; every problem becomes a SpecError naming the file and the field."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such spec file")
    if path.is_dir():
        raise SpecError(f"{path}: is a directory, expected a YAML spec file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{path}{where}: malformed YAML: {problem}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file") from None
    name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip(".-_") or "job"
    return parse_spec(raw, path.resolve().parent, overrides, default_name=name, origin=str(path))
