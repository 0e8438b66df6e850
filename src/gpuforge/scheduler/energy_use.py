"""The energy each running job and replica uses, measured by the server once a tick (never a figure a job
writes): hardware/energy.py reads the counters (NVML on GPUs, RAPL on CPUs where readable) or estimates
from a device's watts x its measured utilisation; this module says who holds what, where the watts come
from (prices.yaml, else the device catalog), and the grid's intensity at each device's site.

The ledger adds each tick's joules to the minute's row (kWh, gCO2e) and to the job's own figures; the source
and the rule ride along, so no figure is shown without how it was obtained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.hardware.catalog import datasheet_for, load_catalog
from gpuforge.hardware.energy import EnergyMeter, Holder
from gpuforge.prices import load_prices, price_of, prices_path
from gpuforge.runtime.host import usable_cores
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.sharing import cores_in
from gpuforge.settings import current
from gpuforge.store.ledger import Energy
from gpuforge.store.models import Deployment, Job

log = logging.getLogger(__name__)
WATTS_REREAD_S = 60.0  # prices.yaml may change while the server runs (`gpuforge prices set`)


def parse_intensity(text: str | None) -> dict[str, float]:
    """GPUFORGE_GRID_GCO2E_PER_KWH: "350" (every site: key "*") or "onprem=350,edge=50,*=400" ->
    {site: gCO2e/kWh}. GpuforgeError naming the part that is wrong."""
    if not text or not text.strip():
        return {}
    found = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        site, eq, value = part.rpartition("=") if "=" in part else ("*", "=", part)
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not eq or not site.strip() or not 0 <= number <= 5000:
            raise GpuforgeError(
                f"GPUFORGE_GRID_GCO2E_PER_KWH: {part!r} is not a gCO2e/kWh figure (0..5000) or site=figure"
            )
        found[site.strip()] = number
    return found


class EnergyUse:
    """What the scheduler asks once a tick: `measure(jobs, deployments)` -> subject -> Energy."""

    def __init__(self, devices: list[DeviceInfo], home: Path | None, meter: EnergyMeter | None = None):
        self.devices, self.home = devices, home
        self.meter = meter or EnergyMeter(total_cores=usable_cores())
        self.intensity = parse_intensity(current().grid_gco2e_per_kwh)
        self._watts: dict[str, tuple[float, str] | None] = {}
        self._watts_read = -WATTS_REREAD_S

    def measure(self, jobs: Iterable[Job], deployments: Iterable[Deployment]) -> dict[str, Energy]:
        by_id = {d.id: d for d in self.devices}
        holders: list[Holder] = []
        sites: dict[str, DeviceInfo] = {}
        for job in jobs:
            if job.pid is None or not job.devices:
                continue
            held = [by_id[d] for d in job.devices.split(",") if d in by_id]
            if held:
                holders.append(
                    self._holder(f"job:{job.id}", held, job.device_share, (job.pid,), job.isolation)
                )
                sites[f"job:{job.id}"] = held[0]
        for d in deployments:
            up = [w for w in d.workers or () if w.get("pid") and w.get("device") in by_id]
            if not up:
                continue
            held = [by_id[w["device"]] for w in up]
            pids = tuple(int(w["pid"]) for w in up)
            said = next((w.get("isolation") for w in up if w.get("isolation")), None)
            holders.append(self._holder(f"deployment:{d.id}", held, d.device_share, pids, said, len(up)))
            sites[f"deployment:{d.id}"] = held[0]
        try:
            readings = self.meter.measure(holders)
        except Exception as err:  # a counter that misbehaves costs a tick's figure, never the tick
            log.warning("energy not measured this tick: %s", err)
            return {}
        return {
            subject: Energy(r.joules, f"{r.source}: {r.rule}", self._intensity(sites.get(subject)))
            for subject, r in readings.items()
            if r is not None
        }

    def _holder(
        self,
        subject: str,
        held: list[DeviceInfo],
        share: float | None,
        pids: tuple[int, ...],
        isolation: str | None,
        replicas: int = 1,
    ) -> Holder:
        first = held[0]
        watts = self.watts_of(first)
        if first.kind == "cuda":
            indices = tuple(int(d.id.split(":", 1)[1]) for d in held)
            cores = 0
        else:
            indices = ()
            pinned = len(cores_in(isolation))
            per_device = first.threads or 1
            cores = pinned * replicas if pinned else max(1, round((share or 1.0) * per_device * len(held)))
        return Holder(
            subject=subject,
            kind=first.kind,
            indices=indices,
            share=share or 1.0,
            pids=pids,
            cores=cores,
            watts=watts[0] if watts else None,
            watts_from=watts[1] if watts else None,
        )

    def watts_of(self, device: DeviceInfo) -> tuple[float, str] | None:
        """What one whole `device` draws under load, and from where: prices.yaml's entry for its name or
        kind (an owned device's watts), else the catalog's datasheet for its model; re-read every minute."""
        now = time.monotonic()
        if now - self._watts_read > WATTS_REREAD_S:
            self._watts, self._watts_read = {}, now
        if device.id not in self._watts:
            self._watts[device.id] = self._read_watts(device)
        return self._watts[device.id]

    def _read_watts(self, device: DeviceInfo) -> tuple[float, str] | None:
        try:
            prices = load_prices(prices_path(self.home)) if self.home is not None else {}
            found = price_of(prices, device.name, device.kind)
            if found is not None and found[1].watts:
                return found[1].watts, f"prices.yaml {found[0]}"
            model = datasheet_for(load_catalog(self.home), device.name)
        except SpecError as err:  # the admin's file unreadable: no estimate rather than a wrong one
            log.warning("energy: no watts for %s: %s", device.id, err)
            return None
        if model is not None and model.watts:
            return model.watts, f"catalog {model.name}"
        return None

    def _intensity(self, device: DeviceInfo | None) -> float | None:
        if not self.intensity:
            return None
        site = dict(device.labels).get("site") if device is not None else None
        return self.intensity.get(site, self.intensity.get("*")) if site else self.intensity.get("*")
