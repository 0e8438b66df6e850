"""Where jobs' ranks run: one module an executor, each implementing scheduler/executor.py's `Executor`.

`build` reads the settings' `executor` once and is the one place outside launch/ that names a kind:
the server builds its executor at start and hands it to the scheduler, a job's runner builds its own
from the environment the server gave it; neither asks which kind it got.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuforge.scheduler.executor import Executor
    from gpuforge.settings import ServerOptions

SLURM_OPTIONS = ("slurm_partition", "slurm_account", "slurm_qos")


def build(options: ServerOptions, runs_dir: Path | None = None) -> Executor:
    """The executor `options.executor` names, with its settings. `runs_dir`: the server's (a Slurm
    partition's nodes must see it); a runner passes none."""
    slurm = {name: value for name in SLURM_OPTIONS if (value := getattr(options, name))}
    # each implementation imported when chosen: a job's runner on this machine loads no Slurm or store code
    if options.executor == "slurm":
        from gpuforge.executors.slurm_jobs import SlurmExecutor

        given = {name.removeprefix("slurm_"): value for name, value in slurm.items()}
        return SlurmExecutor(given, options.device_labels, runs_dir, options.home)
    misplaced = None
    if slurm:  # Slurm's options on another executor: refused at check(), before the server listens
        from gpuforge.settings import env_name

        names = ", ".join(env_name(name) for name in slurm)
        misplaced = f"{names}: for --executor slurm (this server's is {options.executor})"
    if options.executor == "ray":
        from gpuforge.executors.ray_actors import RayExecutor

        return RayExecutor(options.ray_address, options.device_labels, misplaced)
    from gpuforge.executors.local import LocalExecutor

    return LocalExecutor(options.device_labels, misplaced)
