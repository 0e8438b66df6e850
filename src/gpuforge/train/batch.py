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
from typing import Any

import torch

from gpuforge.errors import GpuforgeError
from gpuforge.hardware.probe import proc_status_bytes
from gpuforge.train import tasks
from gpuforge.train.precision import Precision, autocast

CPU_AVAILABLE_SHARE = 0.8  # of MemAvailable, when no resources.max_memory is set
CUDA_TOTAL_SHARE = 0.92  # of the device's memory: the allocator fragments, kernels need workspace
# A real CPU run peaks ~15% above its measured trial (glibc keeps freed, fragmented pages resident across
# micro-batches; the optimizer's first step allocates beside the gradients): plan with that headroom.
CPU_HEADROOM = 0.85


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


def reset_cpu_peak() -> None:
    try:  # return freed heap pages first, so the next peak counts what the trial really touches
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
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
        return held, int(total * CUDA_TOTAL_SHARE), f"{CUDA_TOTAL_SHARE:.0%} of the GPU's memory"
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
