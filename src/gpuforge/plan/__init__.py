"""The pre-flight plan: will this job fit, how long will it take, what will it cost, before it runs.

    gpuforge plan SPEC [--measure]

Memory is measured, not guessed: two trial forward+backward passes on the longest examples give the
activation bytes per sample (train/batch.py); weights, gradients and AdamW state are counted from the
model. Step time comes from a few real training steps with --measure, otherwise from the FLOP count and
the device's measured matmul peak (a lower bound: it assumes 100% of that peak). `gpuforge train` holds
a job with resources.max_memory to the same memory estimate before it starts (train/batch.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from gpuforge.hardware.bench import peak_flops
from gpuforge.hardware.probe import device_name, proc_status_bytes, synchronize
from gpuforge.runtime.precision import MixedPrecision
from gpuforge.spec import JobSpec, parse_bytes
from gpuforge.train.batch import (
    MemoryProbe,
    available_cpu_bytes,
    fit_verdict,
    measure_memory,
    memory_breakdown,
    reset_cpu_peak,
    size,
    what_would_fit,
)
from gpuforge.train.metrics import FlopModel
from gpuforge.train.setup import Job, build_job
from gpuforge.train.step import forward_backward, make_optimizer

MEASURED_STEPS = 8  # at least, after one warm-up step: two in each window
MEASURED_SECONDS = 2.0  # short steps run until this much time is measured: one stall must not decide
MAX_MEASURED_STEPS = 200
WINDOWS = 4  # the measured steps, cut in this many runs of consecutive steps, each with its median
NOISY = 0.15  # window medians further than this (±, of the median) apart: too noisy to trust as it is
MORE_SECONDS = 3.0  # a noisy measurement goes on up to this many times MEASURED_SECONDS: a burst may pass


@dataclass(frozen=True)
class StepTiming:
    """Real optimizer steps, timed: the median is the estimate; the spread says whether to trust it."""

    times_s: tuple[float, ...]  # each measured step's, in order (the warm-up step left out)
    peak_bytes: int  # the memory the steps reached

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread(self) -> float:
        """Half the range of the windows' medians, as a fraction of the median (0.1: ±10 %): a neighbour's
        burst moves one window, not all of them."""
        size = max(1, len(self.times_s) // WINDOWS)
        windows = [self.times_s[i : i + size] for i in range(0, len(self.times_s) - size + 1, size)]
        medians = [statistics.median(w) for w in windows]
        return (max(medians) - min(medians)) / (2 * self.median_s) if self.median_s > 0 else 0.0

    @property
    def reliable(self) -> bool:
        return self.spread <= NOISY

    def method(self) -> str:
        said = f"median of {len(self.times_s)} measured steps, ±{self.spread:.0%} between windows"
        if self.reliable:
            return said
        return f"{said}: UNRELIABLE, the steps' time moved more than ±{NOISY:.0%} (a busy machine?)"


@dataclass
class Plan:
    job: str
    device: str
    device_type: str
    precision: str
    parameters: int
    trainable_parameters: int
    micro_batch: int
    global_batch: int
    grad_accum: int
    memory: dict[str, int]  # the breakdown; "total" is the predicted peak
    capacity_bytes: int
    capacity_source: str
    fits: bool
    flops_per_step: float
    device_peak_flops: float
    step_time_s: float
    step_time_method: str
    total_steps: int
    total_time_s: float
    usd_per_hour: float
    cost_usd: float
    measured_peak_bytes: int | None = None
    # with --measure: the windows' spread (0.1: ±10 %), whether it is small enough to trust the median,
    # and the fastest step (the step's own cost, with the machine to itself: a neighbour only adds time)
    step_time_spread: float | None = None
    step_time_reliable: bool | None = None
    step_time_fastest_s: float | None = None
    verdict: str = ""  # one line when it does not fit: by how much, and what would (or why nothing can)
    suggestions: list[str] = field(default_factory=list)  # options that fit, each with its predicted peak

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(spec: JobSpec, measure: bool = False) -> Plan:
    job = build_job(spec)
    module, device = job.module, job.device
    max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, device)
    memory = job.search or measure_memory(probe, job.order.global_batch, max_memory)

    breakdown = memory_breakdown(module, memory, job.micro)
    capacity, capacity_source = _capacity(device, max_memory)

    samples, tokens = _global_batch_size_and_tokens(job)
    flops = FlopModel(job.built, job.task, _sample_batch(job), job.precision).step_flops(samples, tokens)
    peak = peak_flops(device, job.precision.name)
    timing = _measure_steps(job) if measure else None
    if timing is not None:
        step_time, method = timing.median_s, timing.method()
    else:
        step_time, method = flops / peak, "FLOPs / measured matmul peak (a lower bound)"
    total_time = step_time * job.total_steps
    plan = Plan(
        job=spec.name,
        device=device_name(device),
        device_type=device.type,
        precision=job.precision.name,
        parameters=sum(p.numel() for p in module.parameters()),
        trainable_parameters=sum(p.numel() for p in module.parameters() if p.requires_grad),
        micro_batch=job.micro,
        global_batch=job.order.global_batch,
        grad_accum=-(-job.order.global_batch // job.micro),
        memory=breakdown,
        capacity_bytes=capacity,
        capacity_source=capacity_source,
        fits=breakdown["total"] <= capacity,
        flops_per_step=flops,
        device_peak_flops=peak,
        step_time_s=step_time,
        step_time_method=method,
        total_steps=job.total_steps,
        total_time_s=total_time,
        usd_per_hour=spec.cost.usd_per_hour,
        cost_usd=total_time * spec.cost.usd_per_hour / 3600,
        measured_peak_bytes=timing.peak_bytes if timing else None,
        step_time_spread=timing.spread if timing else None,
        step_time_reliable=timing.reliable if timing else None,
        step_time_fastest_s=min(timing.times_s) if timing else None,
    )
    if not plan.fits:
        plan.suggestions = what_would_fit(job, memory, breakdown, capacity)
        plan.verdict = fit_verdict(breakdown, capacity, capacity_source, plan.suggestions)
    return plan


def _capacity(device: torch.device, max_memory: int | None) -> tuple[int, str]:
    if max_memory:
        return max_memory, "resources.max_memory"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return min(total, available_cpu_bytes() + memory_in_use()), "the RAM this process can have"


def memory_in_use() -> int:
    return proc_status_bytes("VmRSS") or 0


def _global_batch_size_and_tokens(job: Job) -> tuple[int, int]:
    """Samples and (average) real tokens of one optimizer step."""
    data, n = job.data.train, job.order.global_batch
    if hasattr(data, "ids"):
        return n, int(n * statistics.mean(len(ids) for ids in data.ids))
    if hasattr(data, "blocks"):
        return n, n * data.blocks.shape[1]
    return n, 0


def _sample_batch(job: Job) -> dict[str, torch.Tensor]:
    return {k: v.to(job.device) for k, v in job.data.train.collate(job.order.batch(0)[: job.micro]).items()}


def _measure_steps(job: Job, seconds: float = MEASURED_SECONDS) -> StepTiming:
    """Real optimizer steps after one warm-up: at least MEASURED_STEPS and `seconds`, and while their
    windows disagree by more than NOISY, on up to MORE_SECONDS times as long."""
    module = job.module
    optimizer = make_optimizer(module, job.spec.train.lr, job.spec.train.weight_decay, job.device)
    amp = MixedPrecision(job.precision, job.device)  # as training steps: fp16 with its loss scaling
    times: list[float] = []
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    else:
        reset_cpu_peak()

    def more() -> bool:
        measured, done = sum(times[1:]), len(times) - 1
        if done < MEASURED_STEPS:
            return True
        if done >= MAX_MEASURED_STEPS or measured >= seconds * MORE_SECONDS:
            return False
        return measured < seconds or not StepTiming(tuple(times[1:]), 0).reliable

    with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
        step = 0
        while more():
            start = time.perf_counter()
            indices = job.order.batch(step)
            forward_backward(job.built, job.task, job.data.train, indices, job.micro, amp)
            amp.step(optimizer, module.parameters(), job.spec.train.grad_clip)  # unscale, clip, update
            optimizer.zero_grad(set_to_none=True)
            synchronize(job.device)
            times.append(time.perf_counter() - start)
            step += 1
    if job.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(job.device)
    else:
        peak = proc_status_bytes("VmHWM") or 0
    return StepTiming(tuple(times[1:]), peak)


# --- the table `gpuforge plan` prints: small figures in small units -------------------------------


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def dollars(usd: float) -> str:
    """Whole dollars from $1 up, cents below; a fraction of a cent keeps two significant digits."""
    if usd >= 1:
        return f"${usd:,.2f}"
    cents = usd * 100
    if cents == 0:
        return "0 cents"
    if cents < 0.0001:
        return "under 0.0001 cents"  # below this, f"{:.2g}" would print 7e-05
    return f"{cents:.2g} cents" if cents < 10 else f"{cents:.0f} cents"


def table(p: Plan) -> Table:
    out = Table(title=f"plan: {p.job} on {p.device} ({p.device_type}, {p.precision})", show_header=False)
    out.add_column("what", no_wrap=True)
    out.add_column("figure")
    m = p.memory
    rows = [
        ("parameters", f"{p.parameters:,} ({p.trainable_parameters:,} trainable)"),
        ("batch", f"micro-batch {p.micro_batch} x {p.grad_accum} accumulation = {p.global_batch} per step"),
        ("memory: weights", size(m["weights"])),
        ("memory: gradients", size(m["gradients"])),
        ("memory: optimizer state", size(m["optimizer_state"])),
        (
            "memory: activations",
            f"{size(m['activations'])} ({size(m['activations_per_sample'])} per sample, measured)",
        ),
        ("memory: runtime + step overhead", size(m["runtime"] + m["step_overhead"])),
        (
            "memory: predicted peak",
            f"{size(m['total'])} of {size(p.capacity_bytes)} ({p.capacity_source}): "
            f"{'fits' if p.fits else 'DOES NOT FIT'}",
        ),
        ("step time", f"{duration(p.step_time_s)} ({p.step_time_method})"),
        (
            "total",
            f"{p.total_steps} steps, {duration(p.total_time_s)}, {dollars(p.cost_usd)} "
            f"at ${p.usd_per_hour:g}/h",
        ),
    ]
    if p.measured_peak_bytes:
        rows.insert(8, ("memory: measured peak", f"{size(p.measured_peak_bytes)} (in the measured steps)"))
    for row in rows:
        out.add_row(*row)
    return out
