"""Secrets read from files, not from the command line (every local user reads /proc/<pid>/cmdline): an
API key (`--api-key-file`), a store URL with its password (`--db-file`); and a store URL as it may be
shown, its password masked."""

from __future__ import annotations

import re
from pathlib import Path

from gpuforge.errors import GpuforgeError


def read_secret_file(path: Path, option: str, holds: str) -> str:
    """The first line of `path`, stripped; a file that cannot give one is one line naming it."""
    try:
        with path.open(encoding="utf-8") as file:
            line = file.readline().strip()
    except OSError as err:
        raise GpuforgeError(f"{option} {path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise GpuforgeError(f"{option} {path}: not UTF-8 text") from None
    if not line:
        raise GpuforgeError(f"{option} {path}: its first line is empty; it should hold {holds}")
    return line


def url_with_password_masked(url: str) -> str | None:
    """`url` as it may be shown if it holds a password, in its user part or its query (None if none)."""
    from sqlalchemy import make_url

    try:
        parsed = make_url(url)
    except Exception:  # ArgumentError, ValueError: not a URL sqlalchemy reads; it may still hold one
        return url.partition(":")[0] + ":..." if re.match(r"^[^:/@]+://[^/@]*:[^/@]*@", url) else None
    secret = [k for k in parsed.query if "password" in k.lower()]
    if parsed.password is None and not secret:
        return None
    shown = parsed.set(query={k: ("***" if k in secret else v) for k, v in parsed.query.items()})
    return shown.render_as_string(hide_password=True)


def shown_url(url: str) -> str:
    """`url` with any password masked: what an error message may print."""
    return url_with_password_masked(url) or url
