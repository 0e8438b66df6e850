"""Fractions of a device (resources.devices: 0.5): which device a fraction goes to, and what isolates it
there.

Packing is best fit: a fraction goes to the shared device it fills the most (the least room left after
it), and opens a whole free device only when none has room, taking the last free one in hand-out order, so
that the first ones stay whole for jobs that need whole devices (and gangs of them). A fraction never
spans two devices.

Isolation, by kind of device (the job's record says which it got, in words):
- a CPU slot: the share of its cores, pinned (sched_setaffinity, before anything starts a thread) and its
  thread count told to OpenMP/MKL/torch, so two half-slot jobs run side by side on cores of their own;
- a GPU: a memory cap, enforced by PyTorch's allocator in every rank of a spec job
  (torch.cuda.set_per_process_memory_fraction) and, for any process, by a cap-enforcing layer the admin
  installs that reads CUDA_DEVICE_MEMORY_LIMIT (HAMi-core); compute through MPS when the admin runs its
  daemon (GPUFORGE_MPS=1: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), else time
  slicing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuforge.runtime.device_share import (
    MEMORY_CAP_VARIABLE,
    MEMORY_FRACTION_VARIABLE,
    NICE_VARIABLE,
    PIN_VARIABLE,
    SHARE_VARIABLE,
)
from gpuforge.scheduler.allocator import DeviceInfo

EPSILON = 1e-6  # shares are multiples of 0.05: sums compare within this
# a training job on a share of a CPU slot runs at this nice: beside a replica's share, or with the server's
# own threads landing on its cores, batch work yields to requests (the kernel weighs nice 10 at ~1/10)
BATCH_NICE = 10


def room(used: Mapping[str, float], device_id: str) -> float:
    return 1.0 - used.get(device_id, 0.0)


def best_fit(candidates: Iterable[str], used: Mapping[str, float], share: float) -> str | None:
    """The device a fraction `share` goes to among `candidates` (in hand-out order, each free or shared,
    none held whole): the shared one with the least room that still fits it, else the last whole free
    one; None when none has room."""
    shared, whole = None, None
    best_room = 2.0
    for d in candidates:
        left = room(used, d)
        if left >= 1.0 - EPSILON:
            whole = d
        elif share <= left + EPSILON and left < best_room:
            shared, best_room = d, left
    return shared if shared is not None else whole


@dataclass(frozen=True)
class Isolation:
    environment: dict[str, str]  # for the job's processes
    said: str  # what it got, in words: the job's record and page


def cpu_share(share: float, slot_cores: list[int], taken: set[int]) -> Isolation:
    """A share of a CPU slot: round(share x its cores) of them (one at least), the first ones no other
    share of the slot holds (all of the slot's when fewer are left: then they share some)."""
    count = max(1, min(len(slot_cores), round(share * len(slot_cores))))
    free = [c for c in slot_cores if c not in taken]
    cores = (free + [c for c in slot_cores if c in taken])[:count]
    threads = str(len(cores))
    environment = {
        PIN_VARIABLE: ",".join(map(str, sorted(cores))),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        SHARE_VARIABLE: f"{share:g}",
    }
    pinned = "pinned" if len(free) >= count else "pinned, some shared with another job"
    label = ",".join(map(str, sorted(cores)))
    return Isolation(environment, f"cores {label} ({len(cores)} of {len(slot_cores)}, {pinned})")


def gpu_share(share: float, index: str, memory_bytes: int | None, mps: bool) -> Isolation:
    """A share of GPU `index` (the machine's number): its memory capped at share x the device's memory,
    its compute through MPS when the admin runs the daemon, else time-sliced."""
    environment = {"CUDA_VISIBLE_DEVICES": index, SHARE_VARIABLE: f"{share:g}"}
    parts = []
    if memory_bytes:
        cap = int(share * memory_bytes)
        mib = cap // 2**20
        environment |= {
            MEMORY_FRACTION_VARIABLE: f"{share:g}",
            MEMORY_CAP_VARIABLE: str(cap),
            "CUDA_DEVICE_MEMORY_LIMIT": f"{mib}m",  # HAMi-core's, where the admin preloads it
        }
        parts.append(
            f"memory cap {_gib(cap)} (PyTorch allocator; other libraries only where a cap-enforcing layer "
            "such as HAMi-core is installed)"
        )
    if mps:
        percent = max(1, round(share * 100))
        environment |= {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent),
            **({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mib}M"} if memory_bytes else {}),
        }
        parts.append(f"MPS {percent} %")
    else:
        parts.append("time-sliced" if memory_bytes else "time-sliced, no cap")
    return Isolation(environment, ", ".join(parts))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n % 2**30 else f"{n // 2**30} GiB"


_CORES_SAID = re.compile(r"^cores ([\d,]+) ")


def cores_in(said: str | None) -> set[int]:
    """The cores an isolation's words name ("cores 0,1 (2 of 4, pinned)"): those a running share holds."""
    found = _CORES_SAID.match(said or "")
    return {int(c) for c in found.group(1).split(",")} if found else set()


def isolation_for(device: DeviceInfo, share: float, cores_taken: set[int], mps: bool) -> Isolation:
    """What a fraction `share` of `device` gets: cores pinned on a slot of this machine, a memory cap (and
    MPS) on a GPU, a thread count alone on a cluster's CPU (its node places it)."""
    if device.kind == "cuda":
        return gpu_share(share, device.id.split(":", 1)[1], device.memory_bytes, mps)
    if device.cores:
        return cpu_share(share, list(device.cores), cores_taken)
    threads = str(max(1, round(share * (device.threads or 1))))
    environment = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, SHARE_VARIABLE: f"{share:g}"}
    return Isolation(environment, f"{threads} thread(s), not pinned (the cluster's node places it)")


def as_batch_work(isolation: Isolation) -> Isolation:
    """A training job's share of a CPU slot, niced below serving (replicas and the server stay at 0)."""
    if PIN_VARIABLE not in isolation.environment:
        return isolation
    return Isolation(
        {**isolation.environment, NICE_VARIABLE: str(BATCH_NICE)}, f"{isolation.said}, nice {BATCH_NICE}"
    )
