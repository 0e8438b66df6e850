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
- **total time and cost**: steps x step time, at the target's $/h (the catalog's, your devices.yaml's, or
  prices.yaml's for the CPU) times the devices the job uses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.hardware.catalog import CatalogDevice, datasheet_for, load_catalog, resolve
from gpuforge.hardware.machine import DeviceFigures, Machine, machine
from gpuforge.hardware.roofline import OpTrace, Roof, saturating_efficiency
from gpuforge.plan import _capacity, _measure_steps, dollars, duration
from gpuforge.prices import load_prices, price_of, prices_path
from gpuforge.runtime.precision import MixedPrecision, Precision
from gpuforge.settings import current
from gpuforge.spec import JobSpec, parse_bytes
from gpuforge.train.batch import MemoryProbe, lora_trainable_bytes, measure_memory, memory_breakdown, size
from gpuforge.train.setup import Job, build_job
from gpuforge.train.step import forward_backward, make_optimizer

LOCAL = "cpu"  # the one target that is not in the catalog: this machine's CPU, as measured
TRACED_MICRO_STEPS = 3  # micro-batches of different lengths: the estimate is their mean

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
    total_time_s: float
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
    spec: JobSpec, names: list[str], measure: bool = False, link_gbps: float | None = None
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
    traces = _Traces(job)
    calibration = None
    if measure:
        measured, _ = _measure_steps(job)
        local = _local_device(here, job)
        accum = math.ceil(job.order.global_batch / job.micro)
        predicted = traces.step_s(local.roof(job.precision.name), job.micro, accum, job.precision.name)
        calibration = {
            "measured_step_s": measured,
            "roofline_step_s": predicted,
            "factor": measured / predicted,
        }
    targets = {}
    for name, entry in entries.items():
        target = _Target(name, entry, here, job)
        targets[name] = target.plan(spec, breakdown, traces, calibration, link_gbps)
    fitting = [t for t in targets.values() if t.fits]
    if fitting:
        min(fitting, key=lambda t: t.total_time_s).fastest = True
        priced = [t for t in fitting if t.total_cost_usd is not None]
        if priced:
            min(priced, key=lambda t: t.total_cost_usd).cheapest = True
    return Comparison(spec.name, job.total_steps, job.order.global_batch, calibration, targets)


def _resolve(catalog: dict[str, CatalogDevice], name: str) -> CatalogDevice:
    try:
        return resolve(catalog, name)
    except SpecError as err:
        raise SpecError(f"--compare: {err} (or {LOCAL}: this machine's CPU, measured)") from None


def _memory(job: Job, spec: JobSpec):
    max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, job.device)
    return job.search or measure_memory(probe, job.order.global_batch, max_memory)


def _local_device(here: Machine, job: Job) -> DeviceFigures:
    for d in here.devices:
        if d.type == job.device.type:
            return d
    raise GpuforgeError(f"gpuforge hw has no figures for this job's device ({job.device.type})")


class _Traces:
    """One micro-step and one optimizer update of the job, traced here, per precision asked for."""

    def __init__(self, job: Job):
        self.job = job
        self.by_precision: dict[str, tuple[list[OpTrace], OpTrace]] = {}

    def get(self, precision: str) -> tuple[list[OpTrace], OpTrace]:
        precision = "bf16" if precision == "fp16" else precision  # the same bytes; fp16 on a CPU is emulated
        if precision not in self.by_precision:
            self.by_precision[precision] = self._trace(precision)
        return self.by_precision[precision]

    def _trace(self, precision: str) -> tuple[list[OpTrace], OpTrace]:
        job = self.job
        amp = MixedPrecision(Precision(precision, "traced for the comparison"), job.device)
        module = job.module
        optimizer = make_optimizer(module, job.spec.train.lr, job.spec.train.weight_decay, job.device)
        params = list(module.parameters())

        def micro_step(step: int) -> None:
            indices = job.order.batch(step)[: job.micro]
            forward_backward(job.built, job.task, job.data.train, indices, job.micro, amp)

        def update() -> None:
            amp.step(optimizer, module.parameters(), job.spec.train.grad_clip)
            optimizer.zero_grad(set_to_none=True)

        # the weights change here: the plan's job is its own copy, never trained on afterwards
        with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
            micro_step(0)
            update()  # warm-up: kernels' first use; the optimizer's state exists before its update is traced
            micros = [OpTrace.of(lambda s=s: micro_step(s), params) for s in range(1, 1 + TRACED_MICRO_STEPS)]
            optimizer_step = OpTrace.of(update, params, batch_free=True)
        return micros, optimizer_step

    def step_s(self, roof: Roof, micro: int, grad_accum: int | float, precision: str) -> float:
        micros, update = self.get(precision)
        scale = micro / self.job.micro
        one = sum(t.seconds(roof, scale) for t in micros) / len(micros)
        return one * grad_accum + update.seconds(roof)

    def parts(self, roof: Roof, micro: int, grad_accum: int, precision: str) -> dict[str, float]:
        micros, update = self.get(precision)
        scale = micro / self.job.micro
        out = dict.fromkeys(("compute_s", "memory_s", "overhead_s"), 0.0)
        for t in micros:
            for k, v in t.parts(roof, scale).items():
                out[k] += v * grad_accum / len(micros) / roof.step_efficiency
        for k, v in update.parts(roof).items():
            out[k] += v / roof.step_efficiency
        return out


class _Target:
    def __init__(self, name: str, entry: CatalogDevice | None, here: Machine, job: Job):
        self.name, self.entry, self.here, self.job = name, entry, here, job
        self.measured = self._measured_here()

    def _measured_here(self) -> DeviceFigures | None:
        """This machine's CPU for `cpu`; a GPU here that is the catalogued model, for its entry."""
        if self.entry is None:
            return self.here.device("cpu")
        catalog = {self.entry.key: self.entry}
        return next(
            (d for d in self.here.devices if d.type == "cuda" and datasheet_for(catalog, d.name)), None
        )

    def precision(self, spec: JobSpec) -> str:
        asked = spec.train.precision
        if self.entry is None:
            return self.job.precision.name if self.job.device.type == "cpu" else "fp32"
        have = self.measured.matmul_tflops if self.measured else self.entry.tflops
        if asked != "auto":
            if asked not in have:
                raise SpecError(
                    f"train.precision: {asked} is not a precision {self.entry.key} has ({', '.join(have)})"
                )
            return asked
        return next((p for p in ("bf16", "fp16", "fp32") if p in have), "fp32")

    def roof(self, precision: str) -> Roof:
        if self.measured is not None:
            return self.measured.roof(precision)
        e = self.entry
        host_overhead = self.here.device("cpu").roofline["op_overhead_s"]
        return Roof(
            name=e.name,
            peak_tflops=e.tflops.get(precision) or e.tflops.get("fp32") or max(e.tflops.values()),
            efficiency=saturating_efficiency(GPU_MATMUL_BEST, GPU_MATMUL_HALF),
            bandwidth=lambda moved, width: e.memory_bandwidth_gbs * GPU_BANDWIDTH_REACHED,
            op_overhead_s=max(GPU_LAUNCH_S, host_overhead),
            step_efficiency=GPU_STEP_EFFICIENCY,
        )

    def capacity(self, spec: JobSpec) -> tuple[int, str]:
        if self.entry is None:
            max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
            return _capacity(torch.device("cpu"), max_memory)
        return self.entry.memory_bytes, f"{self.entry.key}'s memory"

    def memory(self, breakdown: dict[str, int], micro: int) -> int:
        fixed = breakdown["weights"] + breakdown["gradients"] + breakdown["optimizer_state"]
        fixed += breakdown["step_overhead"]
        host = breakdown["runtime"] if self.entry is None else CUDA_CONTEXT_BYTES
        return host + fixed + breakdown["activations_per_sample"] * micro

    def plan(self, spec, breakdown, traces: _Traces, calibration, link_gbps) -> TargetPlan:
        job = self.job
        precision = self.precision(spec)
        roof = self.roof(precision)
        capacity, capacity_source = self.capacity(spec)
        devices = spec.resources.devices if spec.distributed.strategy != "none" else 1
        per_device = max(1, job.order.global_batch // devices)
        if spec.train.batch_size == "auto":
            fitting = [m for m in range(per_device, 0, -1) if self.memory(breakdown, m) <= capacity]
            micro = fitting[0] if fitting else 1
        else:
            micro = min(job.micro, per_device)
        accum = math.ceil(per_device / micro)
        need = self.memory(breakdown, micro)
        step = traces.step_s(roof, micro, accum, precision)
        parts = traces.parts(roof, micro, accum, precision)
        allreduce_s, advice = self._allreduce(spec, devices, link_gbps, step)
        step += allreduce_s
        parts["allreduce_s"] = allreduce_s
        if calibration:
            step *= calibration["factor"]
            parts = {k: v * calibration["factor"] for k, v in parts.items()}
        total = step * job.total_steps
        usd = self._usd_per_hour(spec)
        fits = need <= capacity
        note = ""
        if not fits:
            over = size(need - capacity)
            note = f"needs {size(need)} at a micro-batch of {micro}, {over} more than {size(capacity)}"
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
            total_time_s=total,
            usd_per_hour=usd,
            total_cost_usd=None if usd is None else total / 3600 * usd * devices,
            note=note,
            advice=advice,
        )

    def _source(self, calibration) -> str:
        base = "measured here (gpuforge hw)" if self.measured is not None else f"catalog: {self.entry.origin}"
        if calibration:
            base += f"; x{calibration['factor']:.2f} as this machine's measured step was to its roofline"
        return base

    def _usd_per_hour(self, spec: JobSpec) -> float | None:
        if self.entry is not None:
            return self.entry.usd_per_hour
        priced = price_of(load_prices(prices_path(current().home)), self.measured.name, "cpu")
        return priced[1].hourly() if priced else spec.cost.usd_per_hour

    def _allreduce(self, spec, devices: int, link_gbps, step_s: float) -> tuple[float, list[str]]:
        """Seconds of the gradients' ring all-reduce over the link, and advice where it dominates."""
        if devices < 2:
            return 0.0, []
        link, where = self._link_gbs(link_gbps)
        grads = [p for p in self.job.module.parameters() if p.requires_grad]
        plain = sum(p.numel() * 4 for p in grads)
        sent = _compressed_bytes(grads, spec.distributed.gradient_compression, spec.distributed.powersgd_rank)
        ring = 2 * (devices - 1) / devices
        seconds = ring * sent / (link * 1e9 * LINK_REACHED)
        advice = []
        share = seconds / (step_s + seconds)
        if share > ALLREDUCE_ADVICE and spec.distributed.gradient_compression != "powersgd":
            cut = ring * _compressed_bytes(grads, "powersgd", 4) / (link * 1e9 * LINK_REACHED)
            advice.append(
                f"all-reduce is {share:.0%} of the step over {where}: "
                f"distributed.gradient_compression: powersgd cuts it to ~{cut / (step_s + cut):.0%}"
            )
        if share > ALLREDUCE_ADVICE and spec.adapt.lora is None:
            lora = lora_trainable_bytes(self.job.built.module)
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
            return (
                measured / LINK_REACHED,
                f"this machine's measured {self.here.allreduce['backend']} all-reduce",
            )
        return 1.25, "10 Gbit/s (no link known: pass --link-gbps)"

    def _lora_advice(self, spec, breakdown, micro: int, capacity: int) -> list[str]:
        if spec.adapt.lora is not None:
            return []
        lora = lora_trainable_bytes(self.job.built.module)
        if lora is None:
            return []
        saved = breakdown["gradients"] + breakdown["optimizer_state"] - 3 * lora
        need = self.memory(breakdown, micro) - saved
        verdict = "fits" if need <= capacity else "still does not fit"
        return [f"adapt.lora: {size(need)} at a micro-batch of {micro} ({verdict})"]


def _compressed_bytes(grads: list[torch.Tensor], kind: str, rank: int) -> float:
    """Bytes of gradients one all-reduce sends with this compression (distributed/compression.py's rule:
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
    return lines
