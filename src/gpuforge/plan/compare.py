"""On which device does this job cost least, and how long will it take there?

    gpuforge plan SPEC --compare h100,a100-80gb,l4,cpu [--measure] [--link-gbps 10] [--json]

One real step of the job runs here, traced op by op (hardware/roofline.py); each target then gets:
- **memory** by the plan's own breakdown (weights, gradients, optimizer state, activations per sample
  measured here) against the target's memory, and the micro-batch it would use (the largest that fits
  where train.batch_size is auto);
- **step time** from the trace on the target's roofline: its matmul peak at the job's precision, its
  memory bandwidth, the fixed cost of each op, over the fraction of that ideal a real step reaches (measured
  by `gpuforge hw` on this machine's devices, a typical figure for catalogued GPUs); plus, for a job on
  several devices, its gradients' all-reduce over the link between them;
- with --measure, every estimate is scaled by what this machine measured for this job over what the
  roofline said for it here (and says so);
- **total time and cost**: steps x step time and the run's evaluations (a traced eval batch on the same
  roofline), at the target's $/h (the catalog's, your devices.yaml's, or prices.yaml's for the CPU) times
  the devices the job uses; not the start-up or the checkpoint writes (`gpuforge plan` times the start-up
  here).

This machine's row is plan/estimate.py's figure, the one `gpuforge plan` prints: one owner for it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from gpuforge.errors import SpecError
from gpuforge.hardware.catalog import CatalogDevice, datasheet_for, load_catalog, resolve
from gpuforge.hardware.machine import DeviceFigures, Machine, machine
from gpuforge.hardware.roofline import Roof, saturating_efficiency
from gpuforge.plan import NOISY, _capacity, _measure_steps, dollars, duration
from gpuforge.plan.estimate import Traces, local_step, require_local_figures
from gpuforge.prices import load_prices, price_of, prices_path
from gpuforge.settings import current
from gpuforge.spec import JobSpec, parse_bytes
from gpuforge.train.batch import (
    CPU_AVAILABLE_SHARE,
    CPU_HEADROOM,
    CUDA_TOTAL_SHARE,
    MemoryProbe,
    lora_trainable_bytes,
    measure_memory,
    memory_breakdown,
    size,
)
from gpuforge.train.lr_find import range_test_steps
from gpuforge.train.setup import Job, build_job

LOCAL = "cpu"  # the one target that is not in the catalog: this machine's CPU, as measured
CALIBRATION_SECONDS = (
    4.0  # of measured steps for --measure: the factor scales every target, so it is timed long
)

# A catalogued GPU we could not measure: typical figures, replaced by `gpuforge hw`'s where one is here.
GPU_MATMUL_BEST = 0.75  # large bf16 GEMMs reach ~70-80% of the dense datasheet peak
GPU_MATMUL_HALF = 768  # ...and half of that at about this edge (the SMs are not all busy below it)
GPU_BANDWIDTH_REACHED = 0.85  # STREAM reaches ~80-90% of the datasheet's HBM bandwidth
GPU_LAUNCH_S = 5e-6  # one kernel launch; the host's own per-op cost counts when it is larger
GPU_STEP_EFFICIENCY = 0.6  # eager PyTorch training reaches ~half to two thirds of the roofline
CUDA_CONTEXT_BYTES = 600 * 2**20  # what CUDA and its libraries hold on the device before any tensor
LINK_REACHED = 0.8  # an all-reduce reaches ~80% of the link's bandwidth
ALLREDUCE_ADVICE = 0.2  # a share of the step over which the all-reduce is worth cutting


@dataclass
class TargetPlan:
    name: str  # as asked: "cpu", "h100"
    device: str
    source: str  # where its figures come from
    runs_gpuforge: bool  # False for a row torch cannot run on (a TPU): an estimate only
    fits: bool
    precision: str
    batch: int  # the micro-batch
    grad_accum: int
    devices: int
    memory_bytes: int  # predicted peak, per device
    capacity_bytes: int
    step_s: float
    step_parts: dict[str, float]  # compute_s, memory_s, overhead_s (the roofline's), allreduce_s
    evaluation_s: float  # every pass over the eval set the run makes, on the same roofline
    total_time_s: float  # steps and evaluations: not the start-up, not the checkpoint writes
    usd_per_hour: float | None
    total_cost_usd: float | None
    cheapest: bool = False
    fastest: bool = False
    note: str = ""  # why it does not fit, and by how much
    advice: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    job: str
    total_steps: int
    global_batch: int
    activations_per_sample_bytes: int  # measured here: what each example of a micro-batch adds on any device
    calibration: dict[str, float] | None  # with --measure: this machine's measured step against its roofline
    targets: dict[str, TargetPlan]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def fits_somewhere(self) -> bool:
        return any(t.fits for t in self.targets.values())

    def verdict(self) -> str:
        """One line for a job that fits nowhere: by how much on the closest device."""
        closest = min(self.targets.values(), key=lambda t: t.memory_bytes - t.capacity_bytes)
        short = closest.memory_bytes - closest.capacity_bytes
        return (
            f"{self.job} fits on none of {', '.join(self.targets)}: the closest is {closest.name} "
            f"({closest.device}), {size(short)} short (needs {size(closest.memory_bytes)} at a micro-batch "
            f"of {closest.batch}, has {size(closest.capacity_bytes)})"
        )


def compare(
    spec: JobSpec,
    names: list[str],
    measure: bool = False,
    link_gbps: float | None = None,
    calibration_s: float = CALIBRATION_SECONDS,
) -> Comparison:
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise SpecError("--compare: name at least one device (e.g. h100,a100-80gb,l4,cpu)")
    catalog = load_catalog()
    entries = {n: None if n.lower() == LOCAL else _resolve(catalog, n) for n in names}  # bad names first
    here = machine()
    job = build_job(spec)
    memory = _memory(job, spec)
    breakdown = memory_breakdown(job.module, memory, job.micro)
    traces = Traces(job)
    calibration = None
    if measure:
        require_local_figures(here, job)
        # the same figure `gpuforge plan --measure` gives: one owner of this device's step (estimate.py)
        local = local_step(job, traces, here, 0.0, _measure_steps(job, calibration_s))
        calibration = {
            "measured_step_s": local.seconds,
            "roofline_step_s": local.roofline_s,
            "factor": local.factor,
            "spread": local.timing.spread,  # the measured steps' (plan.StepTiming): over NOISY, not trusted
        }
    targets = {}
    for name, entry in entries.items():
        target = _Target(name, entry, here, job)
        targets[name] = target.plan(spec, breakdown, traces, calibration, link_gbps)
    fitting = [t for t in targets.values() if t.fits and t.runs_gpuforge]  # an estimate-only row wins nothing
    if fitting:
        min(fitting, key=lambda t: t.total_time_s).fastest = True
        priced = [t for t in fitting if t.total_cost_usd is not None]
        if priced:
            min(priced, key=lambda t: t.total_cost_usd).cheapest = True
    per_sample = breakdown["activations_per_sample"]
    return Comparison(spec.name, job.total_steps, job.order.global_batch, per_sample, calibration, targets)


def _resolve(catalog: dict[str, CatalogDevice], name: str) -> CatalogDevice:
    try:
        return resolve(catalog, name)
    except SpecError as err:
        raise SpecError(f"--compare: {err} (or {LOCAL}: this machine's CPU, measured)") from None


def _memory(job: Job, spec: JobSpec):
    max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, job.device)
    return job.search or measure_memory(probe, job.order.global_batch, max_memory)


class _Target:
    def __init__(self, name: str, entry: CatalogDevice | None, here: Machine, job: Job):
        self.name, self.entry, self.here, self.job = name, entry, here, job
        self.measured = self._measured_here()
        self.is_local_cpu = entry is None

    def _measured_here(self) -> DeviceFigures | None:
        """This machine's CPU for `cpu`; a GPU here that is the catalogued model, for its entry."""
        if self.entry is None:
            return self.here.device("cpu")
        catalog = {self.entry.key: self.entry}
        return next(
            (d for d in self.here.devices if d.type == "cuda" and datasheet_for(catalog, d.name)), None
        )

    def precision(self, spec: JobSpec) -> tuple[str, str]:
        """The precision the job would run in there, and a note where that is not what it asked for."""
        have = self.measured.matmul_tflops if self.measured else self.entry.tflops
        if self.is_local_cpu and self.job.device.type == "cpu":
            wanted = self.job.precision.name
        elif spec.train.precision != "auto":
            wanted = spec.train.precision
        elif self.is_local_cpu:  # as choose_precision decides for a CPU, from the same measured peaks
            wanted = "bf16" if have.get("bf16", 0) >= 1.15 * have["fp32"] else "fp32"
        else:
            wanted = next((p for p in ("bf16", "fp16", "fp32") if p in have), "fp32")
        if wanted in have:
            return wanted, ""
        nearest = next((p for p in ("bf16", "fp16", "fp32", "tf32") if p in have), next(iter(have)))
        why = "emulated" if self.is_local_cpu else "not on its datasheet"
        return nearest, f"{wanted} is {why} on {self.name}: estimated at {nearest}, expect it slower"

    def roof(self, precision: str) -> Roof:
        if self.measured is not None:
            return self.measured.roof(precision)
        e = self.entry
        host_overhead = self.here.device("cpu").roofline["op_overhead_s"]
        return Roof(
            name=e.name,
            peak_tflops=e.tflops[precision],
            efficiency=saturating_efficiency(GPU_MATMUL_BEST, GPU_MATMUL_HALF),
            bandwidth=lambda moved, width: e.memory_bandwidth_gbs * GPU_BANDWIDTH_REACHED,
            op_overhead_s=max(GPU_LAUNCH_S, host_overhead),
            step_efficiency=GPU_STEP_EFFICIENCY,
        )

    def capacity(self, spec: JobSpec) -> tuple[int, int]:
        """The device's memory, and what a run may plan to use of it (as the batch search budgets)."""
        if self.entry is None:
            max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
            total, _ = _capacity(torch.device("cpu"), max_memory)
            return total, int(total * (1 if max_memory else CPU_AVAILABLE_SHARE) * CPU_HEADROOM)
        return self.entry.memory_bytes, int(self.entry.memory_bytes * CUDA_TOTAL_SHARE)

    def memory(self, breakdown: dict[str, int], micro: int, shards: int) -> int:
        """Peak bytes on one device: FSDP shards weights, gradients and optimizer state across devices."""
        state = breakdown["weights"] + breakdown["gradients"] + breakdown["optimizer_state"]
        host = breakdown["runtime"] if self.is_local_cpu else CUDA_CONTEXT_BYTES
        return (
            host
            + -(-state // shards)
            + breakdown["step_overhead"]
            + breakdown["activations_per_sample"] * micro
        )

    def plan(self, spec, breakdown, traces: Traces, calibration, link_gbps) -> TargetPlan:
        job = self.job
        precision, precision_note = self.precision(spec)
        roof = self.roof(precision)
        capacity, budget = self.capacity(spec)
        strategy = spec.distributed.strategy
        devices = spec.resources.processes if strategy != "none" else 1
        # ranks on this one CPU share its cores: no faster than one process, and one machine's price
        machines = 1 if self.is_local_cpu else devices
        share = job.order.global_batch if self.is_local_cpu else -(-job.order.global_batch // devices)
        shards = devices if strategy == "fsdp" and not self.is_local_cpu else 1
        if self.is_local_cpu and job.device.type == "cpu" and devices == 1:
            micro = job.micro  # what the batch search on this machine chose
        elif spec.train.batch_size == "auto":
            candidates = [m for m in range(1, share) if m & (m - 1) == 0] + [share]  # as the search tries
            fitting = [m for m in candidates if self.memory(breakdown, m, shards) <= budget]
            micro = fitting[-1] if fitting else 1
        else:
            micro = min(job.micro, share)
        accum = math.ceil(share / micro)
        need = self.memory(breakdown, micro, shards)
        parts = traces.parts(roof, micro, accum)
        if calibration:  # this machine's measured step against its roofline: the job's compute, not the link
            parts = {k: v * calibration["factor"] for k, v in parts.items()}
        compute = sum(parts.values())
        parts["allreduce_s"], advice = self._allreduce(spec, devices, link_gbps, compute)
        step = compute + parts["allreduce_s"]
        evaluation = traces.all_evaluations_s(roof, micro)
        if calibration:
            evaluation *= calibration["factor"]
        total = step * (range_test_steps(spec.train) + job.total_steps) + evaluation  # lr auto: its test
        usd = self._usd_per_hour(spec)
        fits = need <= capacity
        notes = [precision_note] if precision_note else []
        if not fits:
            over = size(need - capacity)
            notes.append(f"needs {size(need)} at a micro-batch of {micro}, {over} more than {size(capacity)}")
            advice += self._lora_advice(spec, breakdown, micro, capacity)
        return TargetPlan(
            name=self.name,
            device=self.entry.name if self.entry else self.measured.name,
            source=self._source(calibration),
            runs_gpuforge=self.entry is None or self.entry.torch,
            fits=fits,
            precision=precision,
            batch=micro,
            grad_accum=accum,
            devices=devices,
            memory_bytes=need,
            capacity_bytes=capacity,
            step_s=step,
            step_parts=parts,
            evaluation_s=evaluation,
            total_time_s=total,
            usd_per_hour=usd,
            total_cost_usd=None if usd is None else total / 3600 * usd * machines,
            note="; ".join(notes),
            advice=advice,
        )

    def _source(self, calibration) -> str:
        base = "measured here (gpuforge hw)" if self.measured is not None else f"catalog: {self.entry.origin}"
        if calibration:
            base += f"; x{calibration['factor']:.2f} as this machine's measured step was to its roofline"
        return base

    def _usd_per_hour(self, spec: JobSpec) -> float | None:
        """$/h of one device; None where nobody priced it (a spec's 0 means "not tracked", not free)."""
        if self.entry is not None:
            return self.entry.usd_per_hour
        priced = price_of(load_prices(prices_path(current().home)), self.measured.name, "cpu")
        usd = priced[1].hourly() if priced else spec.cost.usd_per_hour
        return usd or None

    def _allreduce(self, spec, devices: int, link_gbps, compute_s: float) -> tuple[float, list[str]]:
        """Seconds of the gradients' traffic between devices a step, and advice where it dominates."""
        if devices < 2:
            return 0.0, []
        link, where = self._link_gbs(link_gbps)
        dist = spec.distributed
        grads = [p for p in self.job.module.parameters() if p.requires_grad]
        plain = sum(p.numel() * 4 for p in grads)
        # DDP: one ring all-reduce of the gradients, 2(n-1)/n of them through each link; FSDP: the
        # parameters' all-gather forward and backward and the gradients' reduce-scatter, 3(n-1)/n
        ring = (3 if dist.strategy == "fsdp" else 2) * (devices - 1) / devices
        sent = _compressed_bytes(grads, dist.gradient_compression, dist.powersgd_rank)
        seconds = ring * sent / (link * 1e9 * LINK_REACHED)
        advice = []
        share = seconds / (compute_s + seconds)
        if share > ALLREDUCE_ADVICE and dist.strategy == "ddp":
            if dist.gradient_compression != "powersgd":
                cut = (
                    ring
                    * _compressed_bytes(grads, "powersgd", dist.powersgd_rank)
                    / (link * 1e9 * LINK_REACHED)
                )
                advice.append(
                    f"all-reduce is {share:.0%} of the step over {where}: "
                    f"distributed.gradient_compression: powersgd cuts it to ~{cut / (compute_s + cut):.0%}"
                )
            lora = lora_trainable_bytes(self.job.built.module) if spec.adapt.lora is None else None
            if lora is not None and lora < plain:
                advice.append(f"adapt.lora sends {size(lora)} of gradients a step instead of {size(plain)}")
        return seconds, advice

    def _link_gbs(self, link_gbps: float | None) -> tuple[float, str]:
        if link_gbps:
            return link_gbps / 8, f"{link_gbps:g} Gbit/s"
        if self.entry is not None and self.entry.interconnect_gbs:
            return (
                self.entry.interconnect_gbs,
                f"{self.entry.key}'s link ({self.entry.interconnect_gbs:g} GB/s)",
            )
        measured = self.here.allreduce.get("bus_gbs")
        if measured:
            backend = self.here.allreduce["backend"]
            return measured / LINK_REACHED, f"this machine's measured {backend} all-reduce"
        return 1.25, "10 Gbit/s (no link known: pass --link-gbps)"

    def _lora_advice(self, spec, breakdown, micro: int, capacity: int) -> list[str]:
        if spec.adapt.lora is not None or spec.distributed.strategy == "fsdp":  # fsdp takes no LoRA yet
            return []
        lora = lora_trainable_bytes(self.job.built.module)
        if lora is None:
            return []
        saved = breakdown["gradients"] + breakdown["optimizer_state"] - 3 * lora
        need = self.memory(breakdown, micro, 1) - saved
        verdict = "fits" if need <= capacity else "still does not fit"
        return [f"adapt.lora: {size(need)} at a micro-batch of {micro} ({verdict})"]


def _compressed_bytes(grads: list[torch.Tensor], kind: str, rank: int) -> float:
    """Bytes of gradients one all-reduce sends with this compression (distributed/grad_compression.py's rule:
    PowerSGD compresses a matrix only when its factors are less than half its size)."""
    total = 0.0
    for g in grads:
        n = g.numel()
        if kind in ("fp16", "bf16"):
            total += 2 * n
        elif kind == "powersgd" and g.dim() >= 2:
            rows, cols = g.shape[0], n // g.shape[0]
            factors = (rows + cols) * rank
            total += 4 * (factors if factors * 2 < rows * cols else n)
        else:
            total += 4 * n
    return total


# --- the table -------------------------------------------------------------------------------------------


def table(c: Comparison) -> Table:
    title = f"plan --compare: {c.job}, {c.total_steps} steps of {c.global_batch} examples"
    if c.calibration:
        title += f" (calibrated: measured step x{c.calibration['factor']:.2f} the roofline's here)"
    out = Table(title=title)
    for col in ("target", "device", "fits", "memory", "batch", "step", "total", "cost", ""):
        out.add_column(col)
    for t in c.targets.values():
        marks = [m for m, on in (("fastest", t.fastest), ("cheapest", t.cheapest)) if on]
        if not t.runs_gpuforge:
            marks.append("estimate only: torch does not run on it")
        out.add_row(
            t.name,
            f"{t.device} ({t.precision})",
            "yes" if t.fits else "NO",
            f"{size(t.memory_bytes)} / {size(t.capacity_bytes)}",
            f"{t.batch} x {t.grad_accum}" + (f" x {t.devices} devices" if t.devices > 1 else ""),
            duration(t.step_s),
            duration(t.total_time_s),
            "-" if t.total_cost_usd is None else dollars(t.total_cost_usd),
            ", ".join(marks),
        )
    return out


def notes(c: Comparison) -> list[str]:
    lines = []
    if c.calibration and c.calibration["spread"] > NOISY:
        lines.append(
            f"calibration: UNRELIABLE, the measured steps moved ±{c.calibration['spread']:.0%} between "
            "windows (a busy machine?): measure again when it is quieter"
        )
    for t in c.targets.values():
        if t.note:
            lines.append(f"{t.name}: {t.note}")
        lines += [f"{t.name}: {a}" for a in t.advice]
        p = t.step_parts
        lines.append(
            f"{t.name}: step {duration(t.step_s)} = compute {duration(p['compute_s'])} + memory "
            f"{duration(p['memory_s'])} + per-op {duration(p['overhead_s'])}"
            + (f" + all-reduce {duration(p['allreduce_s'])}" if p.get("allreduce_s") else "")
            + f"; figures: {t.source}"
        )
    evaluated = any(t.evaluation_s for t in c.targets.values())
    lines.append(
        "total: the steps" + (" and the evaluations" if evaluated else "") + "; not the start-up or the "
        "checkpoint writes (`gpuforge plan` without --compare times the start-up here)"
    )
    return lines
