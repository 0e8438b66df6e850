"""The local executor: jobs' ranks run on this machine, on the devices it has. A job's runner trains in
its own process, or (distributed.strategy ddp|fsdp) starts its ranks through torch's elastic launcher."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuforge.executors.base import RunnerHere
from gpuforge.scheduler.allocator import DeviceInfo, inventory

if TYPE_CHECKING:
    from gpuforge.spec import JobSpec


class LocalExecutor(RunnerHere):
    def _inventory(self) -> list[DeviceInfo]:
        return inventory()

    def launch_ranks(self, spec: JobSpec, out: Path) -> dict[str, Any]:
        from gpuforge.launch.job import launch_local

        return launch_local(spec, out)
