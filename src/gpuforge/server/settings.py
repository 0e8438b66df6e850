"""Server settings: GPUFORGE_* environment variables, or `gpuforge server` options.

GPUFORGE_HOME (default ~/.gpuforge) holds the SQLite file, runs/ and admin.key. GPUFORGE_DATA_ROOTS
(os.pathsep-separated) are the only places on the server a spec may read data from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuforge.server.access import is_loopback


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFORGE_")

    home: Path = Path("~/.gpuforge").expanduser()
    host: str = "127.0.0.1"
    port: int = 8600
    db: str | None = None  # default: sqlite:///<home>/gpuforge.db
    data_roots: str = ""  # os.pathsep-separated directories
    max_body_bytes: int = 64 * 2**20  # specs and uploads above this are refused (413)
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
