"""The Ray executor: jobs' ranks run as actors on a Ray cluster (launch/ray_ranks.py), its GPUs and CPUs
the devices handed out. Every job's runner launches its ranks there, one rank or several."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuforge.errors import GpuforgeError
from gpuforge.executors.base import RunnerHere
from gpuforge.scheduler.allocator import DeviceInfo, cluster_inventory

if TYPE_CHECKING:
    from gpuforge.spec import JobSpec


class RayExecutor(RunnerHere):
    launches_ranks = True

    def __init__(self, address: str | None, labels: str = "", misplaced: str | None = None):
        super().__init__(labels, misplaced)
        self.address = address

    def check(self) -> None:
        """A cluster that does not answer is one clear line before the server listens, not a hang at the
        first job."""
        super().check()
        if not self.address:
            raise GpuforgeError("--executor ray needs --ray-address HOST:PORT (the head node of the cluster)")
        from gpuforge.launch.ray_cluster import connect

        connect(self.address)

    def _inventory(self) -> list[DeviceInfo]:
        from gpuforge.launch.ray_cluster import cluster_devices, connect

        connect(self.address or "")
        return cluster_inventory(cluster_devices())

    def launch_ranks(self, spec: JobSpec, out: Path) -> dict[str, Any]:
        from gpuforge.launch.job import launch_ray

        return launch_ray(spec, out, self.address or "")
