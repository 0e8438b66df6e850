"""The files a script job's working copy holds: `script.files` walked, confined to the job's folder."""

from __future__ import annotations

from pathlib import Path

from gpuforge.errors import SpecError
from gpuforge.spec.sections import ScriptSpec

MAX_SCRIPT_FILES = 2000  # files a script job's working copy may hold (folders counted by their files)


def working_copy_files(script: ScriptSpec, workdir: Path) -> list[str]:
    """The files `script.files` names, folders walked, as paths relative to the working copy (what
    `submit` sends); a SpecError for one that is missing, leaves the folder, or too many."""
    root = workdir.resolve()
    found: list[str] = []
    for name in script.files:
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise SpecError(f"script.files: {name} leaves the job's folder")
        if not path.exists():
            raise SpecError(f"script.files: {name} not found in {root}")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if not f.resolve().is_relative_to(root):
                raise SpecError(f"script.files: {f.relative_to(root)} links outside the job's folder")
            found.append(f.relative_to(root).as_posix())
        if len(found) > MAX_SCRIPT_FILES:
            raise SpecError(f"script.files: over {MAX_SCRIPT_FILES} files; send the data as data, not code")
    return list(dict.fromkeys(found))
