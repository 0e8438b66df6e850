"""Server settings: GPUFORGE_* environment variables, or `gpuforge server` options.

GPUFORGE_HOME (default ~/.gpuforge) holds the SQLite file, runs/ and admin.key, made mode 0700.
GPUFORGE_DATA_ROOTS (os.pathsep-separated) are the only places on the server a spec may read data from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuforge.access import is_loopback
from gpuforge.policy import Policy


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFORGE_")

    home: Path = Path("~/.gpuforge").expanduser()
    host: str = "127.0.0.1"
    port: int = 8600
    db: str | None = None  # default: sqlite:///<home>/gpuforge.db
    data_roots: str = ""  # os.pathsep-separated directories
    max_body_bytes: int = 64 * 2**20  # uploads above this are refused (413)
    max_request_bytes: int = 2**20  # any other body: a spec (256 KiB at most), predictions forwarded
    max_streams_per_key: int = 8  # live log/metrics streams one key holds open at once (429 past it)
    public_metrics: bool = False  # /metrics, /docs and /openapi.json without a key
    schedule: bool = True  # run queued jobs (off: an API-only server, for tests of the API alone)
    admin_key: str | None = None  # the admin key to use on a new store, instead of making admin.key
    allow_user_code: bool = False  # let any key submit python: models (their code runs as the server's user)
    executor: Literal["local", "ray"] = "local"  # where a job's processes run: here, or on a Ray cluster
    ray_address: str | None = None  # the Ray cluster's address (host:port of its head), for executor ray

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.host)

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{self.home / 'gpuforge.db'}"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def uploads_dir(self) -> Path:
        return self.home / "uploads"  # content-addressed data files sent with `gpuforge submit`

    @property
    def roots(self) -> list[Path]:
        return [Path(p).expanduser().resolve() for p in self.data_roots.split(os.pathsep) if p]

    def make_home(self) -> None:
        """GPUFORGE_HOME and runs/, mode 0700: the store, the keys and every run are the server's alone
        (a home made earlier with wider modes is narrowed)."""
        for path in (self.home, self.runs_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)


def job_policy(settings: Settings, key) -> Policy:
    """What a key's jobs and deployments may do: user code for admins (or when the server allows it for
    everyone), and files only under the data roots and the uploads directory."""
    return Policy(
        user_code=bool((key is not None and key.admin) or settings.allow_user_code),
        roots=(*settings.roots, settings.uploads_dir.resolve()),
        excluded=(settings.home,),  # a data root above the home must not open other users' runs
    )
