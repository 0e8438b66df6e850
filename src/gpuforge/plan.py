"""The pre-flight plan: will this job fit, how long will it take, what will it cost, before it runs.

    gpuforge plan SPEC [--measure]

Memory is measured, not guessed: two trial forward+backward passes on the longest examples give the
activation bytes per sample (train/batch.py); weights, gradients and AdamW state are counted from the
model. Step time comes from a few real training steps with --measure, otherwise from the FLOP count and
the device's measured matmul peak (a lower bound: it assumes 100% of that peak).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpuforge.hardware.bench import peak_flops
from gpuforge.hardware.probe import device_name, proc_status_bytes, synchronize
from gpuforge.spec import JobSpec, parse_bytes
from gpuforge.train.adapt import ADAPTABLE, DEFAULT_TARGETS, adaptable_names, resolve_targets
from gpuforge.train.batch import MemoryProbe, available_cpu_bytes, measure_memory, reset_cpu_peak
from gpuforge.train.engine import forward_backward, make_optimizer
from gpuforge.train.metrics import FlopModel
from gpuforge.train.setup import Job, build_job

MEASURED_STEPS = 5  # at least, after one warm-up step; the median is the estimate
MEASURED_SECONDS = 2.0  # short steps run until this much time is measured: one stall must not decide
MAX_MEASURED_STEPS = 200
LORA_RANK_FOR_ADVICE = 8


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
    suggestions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(spec: JobSpec, measure: bool = False) -> Plan:
    job = build_job(spec)
    module, device = job.module, job.device
    max_memory = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, device)
    memory = job.search or measure_memory(probe, job.order.global_batch, max_memory)

    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    weights += sum(b.numel() * b.element_size() for b in module.buffers())
    gradients = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    optimizer = 2 * sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
    held = memory.persistent_bytes - optimizer  # what the process holds now: runtime, data, weights
    breakdown = {
        "runtime": max(0, held - weights),  # interpreter, libraries, data set (CPU); 0 on a GPU's allocator
        "weights": weights,
        "gradients": gradients,
        "optimizer_state": optimizer,
        "activations_per_sample": memory.per_sample_bytes,
        "activations": memory.per_sample_bytes * job.micro,
        "step_overhead": max(0, memory.step_overhead_bytes - gradients),  # a trial's peak holds the gradients
    }
    breakdown["total"] = sum(v for k, v in breakdown.items() if k != "activations_per_sample")
    capacity, capacity_source = _capacity(device, max_memory)

    samples, tokens = _global_batch_size_and_tokens(job)
    flops = FlopModel(job.built, job.task, _sample_batch(job), job.precision).step_flops(samples, tokens)
    peak = peak_flops(device, job.precision.name)
    measured_peak = None
    if measure:
        step_time, measured_peak = _measure_steps(job)
        method = "median of measured steps (at least 5 and 2 s)"
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
        measured_peak_bytes=measured_peak,
    )
    if not plan.fits:
        plan.suggestions = _what_would_fit(job, memory, breakdown, capacity)
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


def _measure_steps(job: Job) -> tuple[float, int]:
    """Median time of real optimizer steps (after one warm-up), and the peak memory they reached."""
    module = job.module
    optimizer = make_optimizer(module, job.spec.train.lr, job.spec.train.weight_decay, job.device)
    times = []
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    else:
        reset_cpu_peak()
    with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
        step = 0
        while step <= MEASURED_STEPS or (sum(times[1:]) < MEASURED_SECONDS and step <= MAX_MEASURED_STEPS):
            start = time.perf_counter()
            indices = job.order.batch(step)
            forward_backward(
                job.built, job.task, job.data.train, indices, job.micro, job.precision, job.device, None
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(job.device)
            times.append(time.perf_counter() - start)
            step += 1
    if job.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(job.device)
    else:
        peak = proc_status_bytes("VmHWM") or 0
    return statistics.median(times[1:]), peak


def _what_would_fit(job: Job, memory, breakdown: dict[str, int], capacity: int) -> list[str]:
    """Options that bring the predicted peak under the capacity, each with its predicted peak."""
    gib = 2**30
    short = breakdown["total"] - capacity
    options = []
    fitting = [m for m in range(job.micro - 1, 0, -1) if memory.predicted_bytes(m) <= capacity]
    if fitting:
        m = fitting[0]
        predicted = memory.predicted_bytes(m) / gib
        options.append(f"train.batch_size: {m} (global batch kept by accumulation): {predicted:.2f} GiB")
    if job.spec.adapt.lora is None:
        lora_trainable = _lora_trainable_bytes(job)
        if lora_trainable is not None:
            saved = breakdown["gradients"] + breakdown["optimizer_state"] - 3 * lora_trainable
            options.append(
                f"adapt.lora (r={LORA_RANK_FOR_ADVICE}): about {(breakdown['total'] - saved) / gib:.2f} GiB "
                "(no gradients or optimizer state for the frozen base)"
            )
    if not job.spec.train.gradient_checkpointing and hasattr(job.built.module, "config"):
        saved = int(breakdown["activations"] * 0.7)  # keeps layer inputs only: roughly a third remains
        options.append(
            f"train.gradient_checkpointing: true: about {(breakdown['total'] - saved) / gib:.2f} GiB"
        )
    return [
        f"needs {breakdown['total'] / gib:.2f} GiB, {short / gib:.2f} GiB more than the "
        f"{capacity / gib:.2f} GiB available"
    ] + options


def _lora_trainable_bytes(job: Job) -> int | None:
    """Bytes of LoRA factors (rank 8 on the default targets) plus a classification head, if any."""
    module = job.module
    try:
        targets = resolve_targets(module, list(DEFAULT_TARGETS))
    except Exception:
        return None
    modules = dict(module.named_modules())
    count = 0
    for name in targets:
        m = modules[name]
        if isinstance(m, ADAPTABLE) and hasattr(m, "weight"):
            out_features, in_features = m.weight.shape[0], m.weight.shape[-1]
            count += LORA_RANK_FOR_ADVICE * (in_features + out_features)
    head = next(
        (modules[n] for n in adaptable_names(module) if n.split(".")[-1] in ("classifier", "score")), None
    )
    if head is not None:
        count += sum(p.numel() for p in head.parameters())
    return count * 4
