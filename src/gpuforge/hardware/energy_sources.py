"""The counters energy is read from: RAPL's CPU package counters in sysfs, NVML's GPU energy counter, and
the CPU time in /proc that splits a shared counter between the processes that ran.

Each reader says whether it can read (`available()`), and reads nothing rather than raise where it cannot:
a counter that is absent, unreadable or unsupported leaves the energy to an estimate (energy.py), never to
an error. Only the standard library and, where installed, `pynvml` (the nvidia-ml-py package).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
PROC = Path("/proc")
# a package zone (intel-rapl:0); not its sub-zones (intel-rapl:0:0: core and uncore are parts of the
# package's count, and dram, the memory, is left out: docs/hardware.md says why), nor intel-rapl-mmio:0 (the
# same package through another interface). AMD's packages appear under the same names
PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user nice system idle iowait irq softirq steal ...
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class RaplReader:
    """The CPU packages' energy counters (µJ) under `root`, by zone name (package-0, package-1, ...)."""

    def __init__(self, root: Path = POWERCAP):
        self.root = Path(root)
        self._ranges: dict[str, int] = {}  # zone name -> where its counter wraps

    def _zones(self) -> dict[str, Path]:
        try:
            entries = sorted(p for p in self.root.iterdir() if PACKAGE_ZONE.match(p.name))
        except OSError:  # no powercap here (a VM, a container, not Linux)
            return {}
        zones = {}
        for path in entries:
            name = _read(path / "name")
            # a platform zone (psys) holds the packages and more: summed with them it would count twice
            if name is not None and name.startswith("package"):
                zones[name] = path
        return zones

    def read(self) -> dict[str, int]:
        """zone name -> its counter in µJ, for the packages whose counter this process may read."""
        found = {}
        for name, path in self._zones().items():
            energy = _read(path / "energy_uj")
            if energy is None or not energy.isdigit():
                continue  # mode 0400 since CVE-2020-8694: only root reads it, unless the admin grants it
            if name not in self._ranges:
                limit = _read(path / "max_energy_range_uj")
                self._ranges[name] = int(limit) if limit and limit.isdigit() else 0
            found[name] = int(energy)
        return found

    def available(self) -> bool:
        return bool(self.read())

    def delta_uj(self, before: dict[str, int], after: dict[str, int]) -> int:
        """µJ used between two reads, summed over the zones in both; a counter that passed its range
        (max_energy_range_uj) and began again at 0 counts the rest of its range and its new value."""
        total = 0
        for name in before.keys() & after.keys():
            used = after[name] - before[name]
            if used < 0:
                used += self._ranges.get(name, 0)
            total += max(used, 0)  # a counter reset with no range known: nothing rather than a negative
        return total


class NvmlReader:
    """NVIDIA GPUs' energy counters and utilisation through NVML, by NVML index (the server's cuda:N).

    NVML is initialised once, on first use, under a lock: the scheduler's thread and a route may ask at
    once. No pynvml, no driver or no GPU: unavailable, every figure None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}

    def _module(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._nvml = _initialised_nvml()
            return self._nvml

    def available(self) -> bool:
        return self._module() is not None

    def device_count(self) -> int:
        nvml = self._module()
        if nvml is None:
            return 0
        try:
            return int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError:
            return 0

    def energy_j(self, index: int) -> float | None:
        """Joules GPU `index` used since its driver loaded, or None where NVML cannot say (before Volta,
        some virtual GPUs and MIG instances: NotSupported)."""
        return self._ask(index, lambda nvml, h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)

    def utilisation(self, index: int) -> float | None:
        """The share of NVML's last sample period (1/6 s to 1 s by product) in which a kernel ran, 0..1."""
        return self._ask(index, lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)

    def _ask(self, index: int, question: Any) -> float | None:
        nvml = self._module()
        if nvml is None:
            return None
        try:
            with self._lock:
                if index not in self._handles:
                    self._handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
                handle = self._handles[index]
            return float(question(nvml, handle))
        except nvml.NVMLError:  # NotSupported, a wrong index, a GPU fallen off the bus
            return None


def _initialised_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # a broken driver install raises more than NVMLError: NVML is then absent too
        return None
    return pynvml


def machine_busy_seconds(proc: Path = PROC) -> float:
    """CPU-seconds every CPU of the machine spent busy (user, nice, system, irq, softirq, steal; not
    idle or iowait) since boot, from /proc/stat's first line."""
    text = _read(Path(proc) / "stat")
    if text is None or not text.startswith("cpu "):
        return 0.0
    ticks = text.splitlines()[0].split()[1:]
    return sum(int(ticks[i]) for i in BUSY_FIELDS if i < len(ticks)) / TICKS_PER_SECOND


@dataclass(frozen=True)
class _Times:
    ppid: int
    own: float  # utime + stime, all its threads
    waited: float  # cutime + cstime: its children that ended and were waited for


class ProcessTable:
    """Every process's parent and CPU time, read in one walk over /proc: the meter reads it once per call
    and asks it for each holder's tree."""

    def __init__(self, proc: Path = PROC):
        self._times: dict[int, _Times] = {}
        self._children: dict[int, list[int]] = {}
        try:
            names = [e.name for e in os.scandir(proc) if e.name.isdigit()]
        except OSError:
            names = []
        for name in names:
            times = _process_times(Path(proc) / name / "stat")
            if times is not None:
                self._times[int(name)] = times
                self._children.setdefault(times.ppid, []).append(int(name))

    def tree_seconds(self, pids: Iterable[int]) -> float:
        """CPU-seconds of these processes and their live descendants, with the children each of them
        already waited for: an ended child's time moves to its parent's count, so the sum does not drop
        when a data-loader worker ends. A pid that is gone counts 0."""
        seen: set[int] = set()
        todo = [p for p in pids if p in self._times]
        total = 0.0
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            total += self._times[pid].own + self._times[pid].waited
            todo.extend(self._children.get(pid, ()))
        return total


def tree_cpu_seconds(pids: Iterable[int], proc: Path = PROC) -> float:
    """CPU-seconds these processes and their live descendants used (ProcessTable.tree_seconds)."""
    return ProcessTable(proc).tree_seconds(pids)


def _process_times(path: Path) -> _Times | None:
    text = _read(path)
    if text is None or ")" not in text:
        return None
    # the command name, in parentheses, may hold spaces and ')': the fields start after the last ')'
    fields = text.rpartition(")")[2].split()
    try:
        utime, stime, cutime, cstime = (int(f) / TICKS_PER_SECOND for f in fields[11:15])
        return _Times(ppid=int(fields[1]), own=utime + stime, waited=cutime + cstime)
    except (ValueError, IndexError):
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):  # gone, not permitted, or not a file
        return None
