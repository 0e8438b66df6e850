"""The pre-flight plan: will this job fit, how long will it take, what will it cost, before it runs.

    gpuforge plan SPEC [--measure]

Memory is measured, not guessed: two trial forward+backward passes on the longest examples give the
activation bytes per sample (train/batch.py); weights, gradients and AdamW state are counted from the
model. Step time is plan/estimate.py's, the one `--compare` gives this device: the job's traced step on
the roofline `gpuforge hw` measured here (an estimate), the median of real steps with --measure, and FLOPs
over the measured matmul peak (a lower bound, said so) only for a device `hw` has no figures for. The total
is the run's: its start-up (timed here: the same data and model), its steps and its evaluations; its
checkpoint writes are counted, not timed. `gpuforge train` holds a job with resources.max_memory to the
same memory estimate before it starts (train/batch.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from gpuforge.hardware.bench import peak_flops
from gpuforge.hardware.machine import machine
from gpuforge.hardware.probe import device_name, proc_status_bytes, synchronize
from gpuforge.hardware.timing import NOISY, Timing
from gpuforge.plan.estimate import Traces, evaluations, local_evaluations_s, local_step
from gpuforge.runtime.host import usable_cores
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
from gpuforge.train.lr_find import initial_lr, range_test_steps
from gpuforge.train.metrics import FlopModel
from gpuforge.train.setup import Job, build_job
from gpuforge.train.step import forward_backward, make_optimizer

MEASURED_STEPS = 8  # at least, after one warm-up step: two in each window
MEASURED_SECONDS = 2.0  # short steps run until this much time is measured: one stall must not decide
MAX_MEASURED_STEPS = 200
MORE_SECONDS = 3.0  # a noisy measurement goes on up to this many times MEASURED_SECONDS: a burst may pass


@dataclass(frozen=True)
class StepTiming(Timing):
    """Real optimizer steps, timed (times_s: each measured step's, the warm-up step left out): the median
    is the estimate; the spread (hardware/timing.py, one definition) says whether to trust it."""

    peak_bytes: int  # the memory the steps reached

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
    total_time_s: float  # the run's: start-up + steps + evaluations (checkpoint writes not timed)
    usd_per_hour: float
    cost_usd: float
    measured_peak_bytes: int | None = None
    # with --measure: the windows' spread (0.1: ±10 %), whether it is small enough to trust the median,
    # and the fastest step (the step's own cost, with the machine to itself: a neighbour only adds time)
    step_time_spread: float | None = None
    step_time_reliable: bool | None = None
    step_time_fastest_s: float | None = None
    # what step_time_s is ("estimate", "measured", "lower bound"), and the figures beside it: the estimate
    # `--compare` gives this device (None where `gpuforge hw` has none for it) and the FLOP bound
    step_time_kind: str = ""
    step_time_estimate_s: float | None = None
    step_time_bound_s: float = 0.0
    steps_time_s: float = 0.0  # total_steps x step_time_s
    startup_s: float = 0.0  # process, device, data, model, batch search: timed here, as the run starts alike
    lr_find_steps: int = 0  # train.lr auto: the range test's steps (at most), timed as the run's steps
    lr_find_s: float = 0.0
    evaluations: int = 0  # passes over the eval set (train.eval_every and the last step)
    evaluation_s: float = 0.0  # all of them, on the step's roofline (scaled as the step is with --measure)
    checkpoints: int = 0  # writes the run makes (train.checkpoint_every and the end's), not in the total
    checkpoint_bytes: int = 0  # each: weights (or the adapter) and optimizer state
    share: str = ""  # resources.devices below 1: what its fraction of the device changes in this plan
    verdict: str = ""  # one line when it does not fit: by how much, and what would (or why nothing can)
    suggestions: list[str] = field(default_factory=list)  # options that fit, each with its predicted peak

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(spec: JobSpec, measure: bool = False, launched_s: float = 0.0) -> Plan:
    """`launched_s`: what this process took to get here (interpreter, imports: `process_age_s()` from the
    CLI), which `gpuforge train` pays alike before its set-up; it is part of the plan's start-up."""
    started = time.perf_counter()
    job = build_job(spec)
    startup = launched_s + time.perf_counter() - started
    module, device = job.module, job.device
    max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, device)
    memory = job.search or measure_memory(probe, job.order.global_batch, max_memory)

    breakdown = memory_breakdown(module, memory, job.micro)
    capacity, capacity_source = _capacity(device, max_memory)
    fraction = spec.resources.share
    if fraction is not None and device.type == "cuda" and not max_memory:  # its cap (runtime/device_share.py)
        capacity, capacity_source = int(capacity * fraction), f"{fraction:g} of the GPU's memory, its cap"

    samples, tokens = _global_batch_size_and_tokens(job)
    flops = FlopModel(job.built, job.task, _sample_batch(job), job.precision).step_flops(samples, tokens)
    peak = peak_flops(device, job.precision.name)
    timing = _measure_steps(job) if measure else None
    traces = Traces(job)
    here = machine()  # cached per machine; measured once (gpuforge hw) on the first plan
    local = local_step(job, traces, here, flops / peak, timing)
    step_time = local.seconds
    evaluation = local_evaluations_s(job, traces, here) * local.factor
    slower, share_said = _on_a_share(fraction, device)
    step_time, evaluation = step_time * slower, evaluation * slower
    lr_find_steps = range_test_steps(spec.train)  # train.lr auto: the range test's steps, before step 1
    total_time = startup + step_time * (lr_find_steps + job.total_steps) + evaluation
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
        step_time_method=local.method(),
        total_steps=job.total_steps,
        total_time_s=total_time,
        usd_per_hour=spec.cost.usd_per_hour * (fraction or 1.0),  # a fraction pays that much of the device
        cost_usd=total_time * spec.cost.usd_per_hour * (fraction or 1.0) / 3600,
        measured_peak_bytes=timing.peak_bytes if timing else None,
        step_time_spread=timing.spread if timing else None,
        step_time_reliable=timing.reliable if timing else None,
        step_time_fastest_s=min(timing.times_s) if timing else None,
        step_time_kind=local.kind,
        step_time_estimate_s=local.roofline_s,
        step_time_bound_s=local.bound_s,
        steps_time_s=step_time * job.total_steps,
        startup_s=startup,
        lr_find_steps=lr_find_steps,
        lr_find_s=step_time * lr_find_steps,
        evaluations=evaluations(job),
        evaluation_s=evaluation,
        checkpoints=_checkpoints(job),
        checkpoint_bytes=_checkpoint_bytes(job, breakdown),
        share=share_said,
    )
    if not plan.fits:
        plan.suggestions = what_would_fit(job, memory, breakdown, capacity)
        plan.verdict = fit_verdict(breakdown, capacity, capacity_source, plan.suggestions)
    return plan


def _on_a_share(fraction: float | None, device: torch.device) -> tuple[float, str]:
    """How much slower its steps are on a fraction of the device, and the rule in words. A CPU share runs
    on round(fraction x cores) of them (scheduler/sharing.py): the step's compute scales with the cores at
    best, so the whole machine's step times cores / its cores (an upper bound where memory bandwidth, not
    the cores, limits the step). A GPU share is time-sliced with the other jobs on it (or gets that share
    of its compute through MPS): 1 / fraction when its neighbours are busy, less when they are not."""
    if fraction is None:
        return 1.0, ""
    if device.type == "cuda":
        return 1 / fraction, f"{fraction:g} of the GPU: steps x{1 / fraction:.2g} (its share of the compute)"
    cores = usable_cores()
    mine = max(1, min(cores, round(fraction * cores)))
    return cores / mine, (
        f"{fraction:g} of the CPU slot: {mine} of {cores} cores, steps x{cores / mine:.2g} (compute scales "
        "with the cores at best)"
    )


def _capacity(device: torch.device, max_memory: int | None) -> tuple[int, str]:
    if max_memory:
        return max_memory, "resources.max_memory"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return min(total, available_cpu_bytes() + memory_in_use()), "the RAM this process can have"


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc); 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _checkpoints(job: Job) -> int:
    """Checkpoints the run writes: every train.checkpoint_every steps before the last, and the end's."""
    every = job.spec.train.checkpoint_every
    return ((job.total_steps - 1) // every if every else 0) + 1


def _checkpoint_bytes(job: Job, breakdown: dict[str, int]) -> int:
    saved = [p for p in job.module.parameters() if p.requires_grad or not job.built.adapter]
    return sum(p.numel() * p.element_size() for p in saved) + breakdown["optimizer_state"]


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
    optimizer = make_optimizer(module, initial_lr(job.spec.train.lr), job.spec.train.weight_decay, job.device)
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
        *([("on a fraction", p.share)] if p.share else []),
        *_time_rows(p),
    ]
    if p.measured_peak_bytes:
        rows.insert(8, ("memory: measured peak", f"{size(p.measured_peak_bytes)} (in the measured steps)"))
    for row in rows:
        out.add_row(*row)
    return out


def _time_rows(p: Plan) -> list[tuple[str, str]]:
    """What the run's wall time is made of, then the total: what it holds and what it leaves out."""
    rows = [("time: start-up", f"{duration(p.startup_s)} (the process, data, model and batch, timed here)")]
    if p.lr_find_steps:
        rows.append(
            (
                "time: lr range test",
                f"{p.lr_find_steps} x {duration(p.step_time_s)} = {duration(p.lr_find_s)} "
                "(train.lr auto; at most)",
            )
        )
    rows.append(("time: steps", f"{p.total_steps} x {duration(p.step_time_s)} = {duration(p.steps_time_s)}"))
    if p.evaluations:
        rows.append(("time: evaluations", f"{p.evaluations} x {duration(p.evaluation_s / p.evaluations)}"))
    held = "start-up, " + ("lr range test, " if p.lr_find_steps else "") + "steps"
    held += " and evaluations" if p.evaluations else ""
    left = f"{p.checkpoints} checkpoint write{'s' if p.checkpoints > 1 else ''} of {size(p.checkpoint_bytes)}"
    bound = " at least" if p.step_time_kind == "lower bound" else ""
    rows.append(
        (
            "total",
            f"{p.total_steps} steps,{bound} {duration(p.total_time_s)}, {dollars(p.cost_usd)} at "
            f"${p.usd_per_hour:g}/h ({held}; not timed: {left})",
        )
    )
    return rows
