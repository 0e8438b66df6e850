"""Server settings: GPUFORGE_* environment variables, or `gpuforge server` options.

Their names, types, defaults and meanings are gpuforge/settings.py's `ServerOptions` (README's table of
environment variables); this adds what follows from them: the store's URL, the run and upload directories,
the data roots as paths, and a key's policy.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuforge.access import is_loopback
from gpuforge.errors import GpuforgeError
from gpuforge.notify.transport import Smtp
from gpuforge.policy import Policy
from gpuforge.secret_files import read_secret_file
from gpuforge.settings import ServerOptions, as_environment


class Settings(ServerOptions):
    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.host)

    @property
    def runner_environment(self) -> dict[str, str]:
        """What a job's runner is told of where its processes run (launch/job.py reads it back)."""
        return as_environment(
            executor=self.executor,
            ray_address=self.ray_address,
            slurm_partition=self.slurm_partition,
            slurm_account=self.slurm_account,
            slurm_qos=self.slurm_qos,
        )

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

    def smtp(self) -> Smtp | None:
        """Where email notifications are handed (None: no SMTP server set); its password from
        GPUFORGE_SMTP_PASSWORD or the file GPUFORGE_SMTP_PASSWORD_FILE names, never from a command line."""
        if not self.smtp_host:
            return None
        if not self.smtp_from:
            raise GpuforgeError(
                "GPUFORGE_SMTP_HOST is set without GPUFORGE_SMTP_FROM: the address mail is from"
            )
        if self.smtp_password and self.smtp_password_file:
            raise GpuforgeError("GPUFORGE_SMTP_PASSWORD and GPUFORGE_SMTP_PASSWORD_FILE: give one of them")
        password = self.smtp_password
        if self.smtp_password_file is not None:
            password = read_secret_file(
                self.smtp_password_file, "GPUFORGE_SMTP_PASSWORD_FILE", "the password"
            )
        return Smtp(
            self.smtp_host, self.smtp_from, self.smtp_port, self.smtp_user, password, self.smtp_starttls
        )

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
