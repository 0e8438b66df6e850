"""The energy a job or a deployment uses, window by window, each figure with the rule that gave it.

A GPU's energy is NVML's total-energy counter, times the share of the device the holder has. A CPU job's is
the RAPL package counters times its processes' share of the machine's busy CPU time. Where neither counter
can be read it is estimated: the device's watts under load x utilisation x seconds, and the rule names where
the watts come from. With no counter and no watts there is no figure at all. docs/hardware.md ("Energy")
says how accurate each rule is known to be.

Two users: the scheduler calls `EnergyMeter.measure` once per tick with what holds devices now; a training
process calls `StepEnergy.window` for its per-step `step_energy_j`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpuforge.hardware.energy_sources import (
    PROC,
    NvmlReader,
    ProcessTable,
    RaplReader,
    machine_busy_seconds,
    tree_cpu_seconds,
)

__all__ = [
    "EnergyMeter",
    "Holder",
    "NvmlReader",
    "RaplReader",
    "Reading",
    "StepEnergy",
    "machine_busy_seconds",
    "tree_cpu_seconds",
]


@dataclass(frozen=True)
class Reading:
    joules: float
    source: Literal["nvml", "rapl", "estimated"]
    rule: str  # how the joules were obtained, in words, with the figures that went in


@dataclass(frozen=True)
class Holder:
    subject: str  # "job:12" | "deployment:3"
    kind: str  # "cuda" | "cpu"
    indices: tuple[int, ...]  # physical GPU indices (cuda); () for cpu
    share: float  # the fraction of each device it holds (1.0: whole; 0.5: half)
    pids: tuple[int, ...]  # its root processes: their trees are its processes
    cores: int  # CPU: the cores it holds; GPU: ignored
    watts: float | None  # what ONE whole device draws under load (cpu: the whole CPU package(s))
    watts_from: str | None  # where those watts come from, e.g. "prices.yaml cpu"


@dataclass(frozen=True)
class _Sample:
    """What a holder's window starts from: the counters as they were when it was last seen."""

    at: float
    who: tuple[str, tuple[int, ...], tuple[int, ...]]  # kind, indices, pids: another set starts again
    cpu_s: float  # its processes' CPU-seconds (cpu holders)
    busy_s: float | None  # the machine's busy CPU-seconds, where RAPL is read
    rapl_uj: dict[str, int] = field(default_factory=dict)
    gpu_j: dict[int, float | None] = field(default_factory=dict)


class EnergyMeter:
    """Joules per holder between calls. Each call reads each counter once, whoever shares it, and walks
    /proc once at most (only when a CPU holder is there)."""

    def __init__(
        self,
        rapl: RaplReader | None = None,
        nvml: NvmlReader | None = None,
        proc: Path = PROC,
        clock: Callable[[], float] = time.monotonic,
        total_cores: int | None = None,
    ):
        self.rapl = rapl if rapl is not None else RaplReader()
        self.nvml = nvml if nvml is not None else NvmlReader()
        self.proc = Path(proc)
        self.clock = clock
        self.total_cores = total_cores or os.cpu_count() or 1
        self._last: dict[str, _Sample] = {}

    def measure(self, holders: list[Holder]) -> dict[str, Reading]:
        """Joules each holder used since the previous call that saw it. A subject's first call sets its
        baseline and returns nothing for it; so does a change of its devices or processes. A holder with no
        counter and no watts gets no reading. Subjects absent from this call are forgotten."""
        now = self.clock()
        cpu = any(h.kind == "cpu" for h in holders)
        table = ProcessTable(self.proc) if cpu else None
        rapl = self.rapl.read() if cpu else {}
        busy = machine_busy_seconds(self.proc) if rapl else None
        gpus = {i for h in holders if h.kind == "cuda" for i in h.indices}
        energy = {i: self.nvml.energy_j(i) for i in sorted(gpus)}
        utilisation: dict[int, float | None] = {}  # read only where an estimate needs it, once a device

        def gpu_utilisation(i: int) -> float | None:
            if i not in utilisation:
                utilisation[i] = self.nvml.utilisation(i)
            return utilisation[i]

        readings: dict[str, Reading] = {}
        seen: dict[str, _Sample] = {}
        for h in holders:
            sample = _Sample(
                at=now,
                who=(h.kind, h.indices, h.pids),
                cpu_s=table.tree_seconds(h.pids) if table is not None and h.kind == "cpu" else 0.0,
                busy_s=busy,
                rapl_uj=rapl,
                gpu_j={i: energy[i] for i in h.indices} if h.kind == "cuda" else {},
            )
            seen[h.subject] = sample
            before = self._last.get(h.subject)
            if before is None or before.who != sample.who:
                continue
            reading = self._reading(h, before, sample, gpu_utilisation)
            if reading is not None:
                readings[h.subject] = reading
        self._last = seen
        return readings

    def _reading(
        self, h: Holder, before: _Sample, after: _Sample, gpu_utilisation: Callable[[int], float | None]
    ) -> Reading | None:
        seconds = max(after.at - before.at, 0.0)
        if h.kind == "cpu":
            if before.rapl_uj and after.rapl_uj and before.busy_s is not None and after.busy_s is not None:
                return self._rapl(h, before, after, after.busy_s - before.busy_s)
            return _cpu_estimate(h, max(after.cpu_s - before.cpu_s, 0.0), seconds, self.total_cores)
        pairs = [(before.gpu_j.get(i), after.gpu_j.get(i)) for i in h.indices]
        known = [(b, a) for b, a in pairs if b is not None and a is not None]
        if h.indices and len(known) == len(pairs):
            # a counter that went back: the driver was reloaded, and counts again from 0
            used = sum(a - b if a >= b else a for b, a in known)
            devices = "+".join(f"cuda:{i}" for i in h.indices)
            rule = (
                f"NVML total-energy counter{'s' if len(h.indices) > 1 else ''} of {devices} x {h.share:g}"
                f" ({_whose(h.subject)} share of the device)"
            )
            return Reading(used * h.share, "nvml", rule)
        measured = {i: gpu_utilisation(i) for i in h.indices} if h.kind == "cuda" else {}
        return _device_estimate(h, measured, seconds)

    def _rapl(self, h: Holder, before: _Sample, after: _Sample, busy: float) -> Reading:
        used_j = self.rapl.delta_uj(before.rapl_uj, after.rapl_uj) / 1e6
        mine = max(after.cpu_s - before.cpu_s, 0.0)
        fraction = _clip(mine / busy) if busy > 0 else 0.0
        zones = "+".join(sorted(before.rapl_uj.keys() & after.rapl_uj.keys()))
        rule = (
            f"RAPL {zones} x {fraction:.2f} ({_whose(h.subject)} share of the machine's busy CPU time:"
            f" {mine:.2f} of {busy:.2f} CPU-s)"
        )
        return Reading(used_j * fraction, "rapl", rule)


def _cpu_estimate(h: Holder, cpu_s: float, seconds: float, total_cores: int) -> Reading | None:
    if h.watts is None or h.cores <= 0:
        return None
    cores = min(h.cores, total_cores)
    possible = cores * seconds
    utilisation = _clip(cpu_s / possible) if possible > 0 else 0.0
    joules = h.watts * (cores / total_cores) * utilisation * seconds
    rule = (
        f"estimated: {h.watts:g} W x {cores}/{total_cores} cores x {utilisation:.2f} utilisation"
        f" ({cpu_s:.2f} CPU-s of {possible:.2f}) x {seconds:.1f} s (watts: {_source(h)})"
    )
    return Reading(joules, "estimated", rule)


def _device_estimate(h: Holder, measured: dict[int, float | None], seconds: float) -> Reading | None:
    if h.watts is None:
        return None
    per_device = [measured.get(i) for i in h.indices] or [None]  # a device named by kind alone: one
    assumed = [u is None for u in per_device]
    values = [1.0 if u is None else _clip(u) for u in per_device]
    joules = sum(h.watts * h.share * u * seconds for u in values)
    mean = sum(values) / len(values)
    rule = f"estimated: {h.watts:g} W x {h.share:g} ({_whose(h.subject)} share) x {mean:.2f} utilisation"
    rule += f" x {seconds:.1f} s" + (f" x {len(values)} devices" if len(values) > 1 else "")
    if all(assumed):
        rule += "; utilisation not measured: assumed 100%"
    elif any(assumed):
        unmeasured = ", ".join(f"cuda:{i}" for i, a in zip(h.indices, assumed, strict=True) if a)
        rule += f"; utilisation of {unmeasured} not measured: assumed 100%"
    return Reading(joules, "estimated", rule + f" (watts: {_source(h)})")


class StepEnergy:
    """The energy this training process (and its children) used since the last call, by the meter's
    rules: the runner's per-step `step_energy_j`."""

    SUBJECT = "run"

    def __init__(self, holder: Holder, meter: EnergyMeter | None = None):
        self.holder = holder
        self.meter = meter if meter is not None else EnergyMeter()

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ, kind: str | None = None) -> StepEnergy:
        """From what the server set: GPUFORGE_DEVICE_SHARE (default 1), GPUFORGE_DEVICE_WATTS and
        GPUFORGE_DEVICE_WATTS_FROM (absent: no estimate), GPUFORGE_CPU_CORES, CUDA_VISIBLE_DEVICES (the
        physical GPUs, NVML's indices; entries that are not numbers, such as UUIDs, are left out). `kind` is
        the device it trains on: "cuda" or "cpu"; by default cuda where CUDA_VISIBLE_DEVICES names a GPU."""
        visible = env.get("CUDA_VISIBLE_DEVICES")
        kind = kind or ("cuda" if visible and visible.strip() not in ("", "-1") else "cpu")
        meter = EnergyMeter()
        if visible is None:  # every GPU is visible
            indices = tuple(range(meter.nvml.device_count())) if kind == "cuda" else ()
        else:
            indices = tuple(int(v) for v in visible.split(",") if v.strip().isdigit())
        share = _number(env, "GPUFORGE_DEVICE_SHARE", 1.0)
        if share is None or not 0 < share <= 1:
            raise ValueError(f"GPUFORGE_DEVICE_SHARE={env.get('GPUFORGE_DEVICE_SHARE')!r}: must be in (0, 1]")
        watts = _number(env, "GPUFORGE_DEVICE_WATTS", None)
        named = env.get("GPUFORGE_DEVICE_WATTS_FROM") or "GPUFORGE_DEVICE_WATTS"  # the source, always
        holder = Holder(
            subject=cls.SUBJECT,
            kind=kind,
            indices=indices if kind == "cuda" else (),
            share=share,
            pids=(os.getpid(),),
            cores=_cores(env),
            watts=watts,
            watts_from=named if watts is not None else None,
        )
        return cls(holder, meter)

    def window(self) -> Reading | None:
        """Energy since the previous call; the first call sets the baseline and returns None, as does a
        process with no counter and no watts."""
        return self.meter.measure([self.holder]).get(self.SUBJECT)


def _cores(env: Mapping[str, str]) -> int:
    """The cores it holds: those GPUFORGE_CPU_CORES names ("0,1", a share of a slot), else all it may use."""
    named = [c for c in env.get("GPUFORGE_CPU_CORES", "").split(",") if c.strip().isdigit()]
    return len(named) or _usable_cores()


def _number(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: must be 0 or more")
    return value


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _whose(subject: str) -> str:
    return f"the {subject.split(':')[0]}'s"


def _source(h: Holder) -> str:
    return h.watts_from or "source not given"


def _clip(x: float) -> float:
    return min(max(x, 0.0), 1.0)
