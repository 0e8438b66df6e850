"""Who may run code of their own choosing, and which files a job may read: one rule for the server's
submit, the runner it starts and the serving worker it starts.

A process the server starts is told through its environment, which the job cannot change:

    GPUFORGE_USER_CODE=0        not an admin's job or deployment: no python: models, no
                                trust_remote_code (the model.options allow-list says the rest)
    GPUFORGE_CONFINE_ROOTS=a:b  every file it reads (after symlinks) lies under one of these...
    GPUFORGE_CONFINE_EXCLUDED   ...and not under one of these (the server's home: other users' runs),
                                unless under a root inside it (its uploads)

A process a person starts by hand (`gpuforge train`, `gpuforge serve`) gets neither: it runs as that
person, with their code and their files. The server checks the same rules at submit, so a refusal is a
422 there; the runner checks them again because a spec on disk may have been edited, or written by an
older version, and a symlink may have changed since.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuforge import settings
from gpuforge.errors import SpecError

MAX_FILES_CHECKED = 10_000  # a model directory with more files than this is refused rather than walked


@dataclass(frozen=True)
class Policy:
    user_code: bool = True  # python: models and trust_remote_code
    roots: tuple[Path, ...] | None = None  # None: any path (a person at their own shell)
    excluded: tuple[Path, ...] = ()  # inside the roots, yet not readable (but for a root inside them)

    @classmethod
    def from_env(cls) -> Policy:
        told = settings.current()
        return cls(user_code=told.user_code, roots=told.confine_roots, excluded=told.confine_excluded)

    def environment(self) -> dict[str, str]:
        """What a child must be told to hold to this policy (see the module's docstring)."""
        confined = self.roots is not None
        return settings.as_environment(
            user_code=self.user_code,
            confine_roots=self.roots,
            confine_excluded=self.excluded if confined else None,
        )

    def check_path(self, field: str, path: Path | str) -> None:
        """A SpecError unless `path`, and for a directory every file in it, lies inside the roots once
        symlinks and `..` are followed."""
        if self.roots is None:
            return
        path = Path(path)
        roots = [r.resolve() for r in self.roots]  # once a check, not once a file of a directory
        places = [*roots, *(e.resolve() for e in self.excluded)]
        self._inside(field, path, path, roots, places)
        if path.is_dir():
            for count, child in enumerate(_walk(path)):
                if count >= MAX_FILES_CHECKED:
                    raise SpecError(f"{field}: {path} holds over {MAX_FILES_CHECKED} files")
                self._inside(field, path, child, roots, places)

    @staticmethod
    def _inside(field: str, named: Path, path: Path, roots: list[Path], places: list[Path]) -> None:
        through = "" if path == named else f" (through {path})"
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as err:  # a symlink loop, on Python < 3.13 a RuntimeError
            raise SpecError(f"{field}: {named}{through} cannot be resolved ({err})") from None
        # the nearest of the roots and the excluded places that holds it decides: a root inside an
        # excluded place (uploads in the server's home) is readable, the rest of that place is not
        holders = [p for p in places if p == real or p in real.parents]
        nearest = max(holders, key=lambda p: len(p.parts), default=None)
        if nearest is None or nearest not in roots:
            allowed = ", ".join(map(str, roots)) or "none configured (GPUFORGE_DATA_ROOTS)"
            raise SpecError(f"{field}: {named}{through} is outside the server's data roots ({allowed})")


def _walk(directory: Path) -> Iterable[Path]:
    """Every entry under `directory`, into linked directories too (each link is checked where it points,
    then what lies there; a link loop ends at MAX_FILES_CHECKED)."""
    for parent, dirs, files in os.walk(directory, followlinks=True):
        for name in [*dirs, *files]:
            yield Path(parent) / name


def current() -> Policy:
    return Policy.from_env()
