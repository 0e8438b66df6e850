"""Automatic micro-batch size: the largest that fits the device's memory, found in a few trial steps.

Memory is measured, not guessed: trial forward+backward passes on the longest examples at two small
micro-batch sizes give the bytes per sample; the persistent costs (weights, gradients, optimizer state)
are added; the largest micro-batch (a power of two, or the global batch) under the budget wins.
- CUDA: the allocator's peak; the pick is then verified by one trial (an OOM there halves it).
- CPU: the process's peak resident memory (Linux /proc), against `resources.max_memory`, or 80% of what
  the machine has available. A CPU is never probed by running out of memory: the kernel's OOM killer
  would end the process before Python sees an error.
Trials leave no trace: gradients are dropped, buffers (batch-norm statistics) and RNG states restored.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gpuforge.errors import GpuforgeError
from gpuforge.hardware.probe import proc_status_bytes
from gpuforge.runtime import tasks
from gpuforge.runtime.device_share import memory_cap
from gpuforge.runtime.precision import Precision, autocast
from gpuforge.spec import parse_bytes
from gpuforge.train.adapt import ADAPTABLE, DEFAULT_TARGETS, adaptable_names, resolve_targets

if TYPE_CHECKING:
    from gpuforge.train.setup import Job

CPU_AVAILABLE_SHARE = 0.8  # of MemAvailable, when no resources.max_memory is set
CUDA_TOTAL_SHARE = 0.92  # of the device's memory: the allocator fragments, kernels need workspace
# A real CPU run peaks ~15% above its measured trial (glibc keeps freed, fragmented pages resident across
# micro-batches; the optimizer's first step allocates beside the gradients): plan with that headroom.
CPU_HEADROOM = 0.85
CHECKPOINTING_KEEPS = 0.3  # of the activations: gradient checkpointing keeps each layer's input only
LORA_RANK_FOR_ADVICE = 8


@dataclass
class BatchSearch:
    micro: int
    budget_bytes: int
    budget_source: str
    per_sample_bytes: int
    step_overhead_bytes: int  # transient bytes of a step that do not grow with the batch
    persistent_bytes: int  # what stays: weights, gradients, optimizer state, the process itself
    trials: list[dict[str, Any]] = field(default_factory=list)

    def predicted_bytes(self, micro: int) -> int:
        return self.persistent_bytes + self.step_overhead_bytes + self.per_sample_bytes * micro

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- memory readings -------------------------------------------------------------------------------


def _proc_status(key: str) -> int:
    value = proc_status_bytes(key)
    if value is None:
        raise GpuforgeError(f"/proc/self/status has no {key}")
    return value


def return_freed_heap() -> None:
    """Give freed heap pages back to the system: RSS then counts what is live, not what a trial freed
    (left resident, it made the same process read 450 to 540 MiB held from one run to the next)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_cpu_peak() -> None:
    return_freed_heap()  # so the next peak counts what the trial really touches
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def available_cpu_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise GpuforgeError("/proc/meminfo has no MemAvailable")


def _can_measure_cpu() -> bool:
    return os.path.exists("/proc/self/clear_refs") and os.access("/proc/self/clear_refs", os.W_OK)


# --- trials ----------------------------------------------------------------------------------------


def longest_first(data) -> list[int]:
    """Example indices, longest sequences first: trials must see the worst case."""
    ids = getattr(data, "ids", None)
    if ids is None:
        return list(range(len(data)))
    return sorted(range(len(ids)), key=lambda i: -len(ids[i]))


def trial_peak_bytes(built, task: str, data, indices: list[int], precision: Precision, device) -> int:
    """Peak bytes one forward+backward on these examples adds on top of what is held now."""
    module = built.module
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            batch = {k: v.to(device) for k, v in data.collate(indices).items()}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            else:
                reset_cpu_peak()
                before = _proc_status("VmRSS")
            with autocast(precision, device):
                logits = tasks.forward(built, task, batch)
            loss, terms = tasks.loss_sum_and_count(task, logits, batch)
            (loss / terms).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device)
            else:
                peak = _proc_status("VmHWM")
            del logits, loss, batch
    finally:
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return max(0, peak - before)


def _candidates(global_batch: int) -> list[int]:
    sizes, m = [], 1
    while m < global_batch:
        sizes.append(m)
        m *= 2
    return sizes + [global_batch]


def _budget(device, max_memory: int | None) -> tuple[int, int, str]:
    """(bytes held now, bytes the run may use, where that budget comes from)."""
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device)
        if max_memory:
            return held, max_memory, "resources.max_memory"
        total = torch.cuda.get_device_properties(device).total_memory
        if (capped := memory_cap()) is not None:  # a fraction of the GPU: its cap is the memory it has
            share, cap = capped
            return (
                held,
                int(cap * CUDA_TOTAL_SHARE),
                f"{CUDA_TOTAL_SHARE:.0%} of its cap ({share:g} of the GPU)",
            )
        return held, int(total * CUDA_TOTAL_SHARE), f"{CUDA_TOTAL_SHARE:.0%} of the GPU's memory"
    return_freed_heap()
    held = _proc_status("VmRSS")
    if max_memory:
        budget, source = max_memory, "resources.max_memory"
    else:
        budget = held + int(available_cpu_bytes() * CPU_AVAILABLE_SHARE)
        source = f"{CPU_AVAILABLE_SHARE:.0%} of available RAM"
    return held, int(budget * CPU_HEADROOM), f"{source}, less {1 - CPU_HEADROOM:.0%} headroom"


class MemoryProbe:
    """Trial steps on the longest examples of a data set; `peak(m)` is None where m runs out of memory."""

    def __init__(self, built, task: str, data, precision: Precision, device):
        if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not _can_measure_cpu()):
            raise GpuforgeError(
                f"memory cannot be measured on this {device.type} (needs CUDA, or Linux /proc)"
            )
        self.built, self.task, self.data, self.precision, self.device = built, task, data, precision, device
        self.order = longest_first(data)

    def peak(self, micro: int) -> int | None:
        try:
            return trial_peak_bytes(
                self.built, self.task, self.data, self.order[:micro], self.precision, self.device
            )
        except torch.OutOfMemoryError:
            return None


def measure_memory(probe: MemoryProbe, global_batch: int, max_memory: int | None) -> BatchSearch:
    """Bytes per sample and fixed costs, from two small trials (the peaks include the gradients)."""
    probe.peak(1)  # warm-up: one-time allocations (kernels, allocator pools) are not per-sample costs
    small, large = min(2, global_batch), min(8, global_batch)
    peaks = {m: probe.peak(m) for m in sorted({small, large})}
    if None in peaks.values():
        raise GpuforgeError(f"a micro-batch of {small} already runs out of memory on this device")
    per_sample = (
        max(1, (peaks[large] - peaks[small]) // max(1, large - small)) if large > small else peaks[small]
    )
    trainable = [p for p in probe.built.module.parameters() if p.requires_grad]
    optimizer_state = 2 * sum(p.numel() * 4 for p in trainable)  # AdamW: two fp32 moments per parameter
    held, budget, source = _budget(probe.device, max_memory)
    return BatchSearch(
        0,
        budget,
        source,
        per_sample,
        peaks[small] - per_sample * small,
        held + optimizer_state,
        [{"micro": m, "peak_bytes": p} for m, p in peaks.items()],
    )


def search_micro_batch(
    built, task: str, data, global_batch: int, precision: Precision, device, max_memory: int | None
) -> BatchSearch:
    """The largest micro-batch (power of two, or the whole global batch) that fits; see module doc."""
    probe = MemoryProbe(built, task, data, precision, device)
    search = measure_memory(probe, global_batch, max_memory)
    budget = search.budget_bytes
    candidates = [m for m in _candidates(global_batch) if search.predicted_bytes(m) <= budget]
    if not candidates:
        need = search.predicted_bytes(1) / (CPU_HEADROOM if device.type == "cpu" else 1)
        declared = max_memory or budget
        raise GpuforgeError(
            f"resources.max_memory: {declared / 2**30:.2f} GiB is too small for a batch of one: that needs "
            f"{need / 2**30:.2f} GiB (model and optimizer state {search.persistent_bytes / 2**30:.2f} GiB, "
            f"gradients and one sample's activations {search.predicted_bytes(1) - search.persistent_bytes:,} "
            f"bytes{', with 15% headroom' if device.type == 'cpu' else ''})"
        )
    # memory grows a little faster than linearly at large batches: measure the pick, step down if over
    measured = {t["micro"]: t["peak_bytes"] for t in search.trials}
    while True:
        pick = candidates.pop()
        peak = measured.get(pick) or probe.peak(pick)
        search.trials.append({"micro": pick, "peak_bytes": peak})
        if (peak is not None and search.persistent_bytes + peak <= budget) or not candidates:
            search.micro = pick
            return search


# --- will it fit: the estimate `gpuforge plan` prints and `gpuforge train` holds to ----------------


def size(n: float) -> str:
    """Bytes as people read them: GiB from one GiB up, MiB from one MiB up, KiB below."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    unit, value = ("MiB", n / 2**20) if abs(n) >= 2**20 else ("KiB", n / 2**10)
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


def memory_breakdown(module: torch.nn.Module, memory: BatchSearch, micro: int) -> dict[str, int]:
    """The predicted peak in parts; "total" is memory.predicted_bytes(micro)."""
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
        "activations": memory.per_sample_bytes * micro,
        "step_overhead": max(0, memory.step_overhead_bytes - gradients),  # a trial's peak holds the gradients
    }
    breakdown["total"] = sum(v for k, v in breakdown.items() if k != "activations_per_sample")
    return breakdown


def what_would_fit(job: Job, memory: BatchSearch, breakdown: dict[str, int], capacity: int) -> list[str]:
    """Options whose predicted peak is under the capacity, each with that peak (none, if none fits)."""
    options = []  # (what to set, predicted bytes, why it saves)
    fitting = [m for m in range(job.micro - 1, 0, -1) if memory.predicted_bytes(m) <= capacity]
    if fitting:
        options.append(
            (f"train.batch_size: {fitting[0]}", memory.predicted_bytes(fitting[0]), "global batch kept")
        )
    if job.spec.adapt.lora is None:
        lora_trainable = lora_trainable_bytes(job.built.module)
        if lora_trainable is not None:
            saved = breakdown["gradients"] + breakdown["optimizer_state"] - 3 * lora_trainable
            options.append(
                (
                    f"adapt.lora (r={LORA_RANK_FOR_ADVICE})",
                    breakdown["total"] - saved,
                    "no gradients or optimizer state for the frozen base",
                )
            )
    if not job.spec.train.gradient_checkpointing and hasattr(job.built.module, "config"):
        saved = int(breakdown["activations"] * (1 - CHECKPOINTING_KEEPS))
        options.append(("train.gradient_checkpointing: true", breakdown["total"] - saved, "an estimate"))
    return [f"{what}: {size(bytes_)} ({why})" for what, bytes_, why in options if bytes_ <= capacity]


def fit_verdict(breakdown: dict[str, int], capacity: int, source: str, suggestions: list[str]) -> str:
    """One line: by how much the job is over, and what would fit (or why nothing can)."""
    need = breakdown["total"]
    line = f"does not fit: needs {size(need)}, {size(need - capacity)} more than the {size(capacity)} "
    line += f"of {source}"
    if breakdown["runtime"] >= capacity:
        return (
            f"{line}; the runtime alone (what the process holds before the model: interpreter, libraries, "
            f"data) is {size(breakdown['runtime'])}, over that already: nothing can fit"
        )
    if not suggestions:
        return f"{line}; nothing gpuforge can suggest fits under it"
    return f"{line}; would fit with " + " / ".join(suggestions)


def check_memory_budget(job: Job) -> None:
    """Refuse a job whose predicted peak is over resources.max_memory, with `gpuforge plan`'s verdict.
    Cheap: the same two trial passes as the plan, no steps timed. batch_size: auto is sized under the
    budget already; FSDP shards what the estimate counts whole, so it is not held to it here."""
    spec = job.spec
    if not spec.resources.max_memory or job.search is not None or spec.distributed.strategy == "fsdp":
        return
    if job.device.type not in ("cuda", "cpu") or (job.device.type == "cpu" and not _can_measure_cpu()):
        return  # nothing to measure with (MPS, no Linux /proc): `gpuforge plan` says so; the run goes on
    budget = parse_bytes(spec.resources.max_memory)
    probe = MemoryProbe(job.built, job.task, job.data.train, job.precision, job.device)
    memory = measure_memory(probe, job.order.global_batch, budget)
    breakdown = memory_breakdown(job.module, memory, job.micro)
    if breakdown["total"] > budget:
        suggestions = what_would_fit(job, memory, breakdown, budget)
        raise GpuforgeError(fit_verdict(breakdown, budget, "resources.max_memory", suggestions))


def lora_trainable_bytes(module: torch.nn.Module) -> int | None:
    """Bytes of LoRA factors (rank 8 on the default targets) plus a classification head, if any."""
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
