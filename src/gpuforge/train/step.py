"""The pieces of an optimizer step that training, `gpuforge plan` and the pruning recovery share.

    optimizer = make_optimizer(module, lr, weight_decay, device)
    loss, samples, tokens, data_wait = forward_backward(built, task, data, indices, micro, amp)
    amp.step(optimizer, params, max_norm)

forward_backward accumulates the gradients of one step's global batch (or a process's share of it).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from gpuforge.data.batches import micro_batches
from gpuforge.distributed.parallel import Parallel
from gpuforge.models.base import BuiltModel
from gpuforge.runtime import tasks
from gpuforge.runtime.evaluate import to_device
from gpuforge.runtime.phases import phase
from gpuforge.runtime.precision import MixedPrecision


def forward_backward(
    built: BuiltModel,
    task: str,
    data,
    indices: list[int],
    micro: int,
    amp: MixedPrecision,
    parallel: Parallel | None = None,
    global_size: int | None = None,
) -> tuple[float, int, int, float]:
    """Gradients of the mean loss over the step's global batch, of which `indices` is this process's share
    (all of it with one process), summed over micro-batches of at most `micro` examples.

    Each micro-batch's mean loss is weighted by its share of the global batch of `global_size`, so the
    gradient is the same whatever the micro-batch size and the number of processes (DDP and FSDP average
    over processes: the weight is scaled up by their number to undo it). Gradients are synchronised across
    processes only after the last micro-batch. Returns (this share's part of the mean loss, samples,
    tokens, seconds spent fetching data)."""
    global_size = global_size or len(indices)
    parallel = parallel if parallel is not None and parallel.strategy != "none" else None
    world = parallel.ranks.world if parallel is not None else 1
    module = parallel.forward_module if parallel is not None else None
    loss_total = torch.zeros((), device=amp.device)
    samples = tokens = 0
    data_wait = 0.0
    chunks = micro_batches(indices, micro)
    for i, chunk in enumerate(chunks):
        fetch_start = time.perf_counter()
        with phase("data_wait"):
            batch = to_device(data.collate(chunk), amp.device)
        data_wait += time.perf_counter() - fetch_start
        with parallel.accumulating(last=i == len(chunks) - 1) if parallel else nullcontext():
            with phase("forward"):
                with amp.autocast():
                    logits = tasks.forward(built, task, batch, module)
                loss_sum, terms = tasks.loss_sum_and_count(task, logits, batch)
                loss = loss_sum / terms * (len(chunk) / global_size)
            with phase("backward"):  # DDP's all-reduces run within it, overlapped with the gradients
                amp.backward(loss * world if world > 1 else loss)
        loss_total += loss.detach()
        n_samples, n_tokens = tasks.count(task, batch)
        samples, tokens = samples + n_samples, tokens + n_tokens
    return float(loss_total), samples, tokens, data_wait  # float(): the one host sync per step, our NaN guard


def make_optimizer(
    module: torch.nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (1-D tensors), as careful users set it up."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused AdamW: one kernel over all tensors; on a CPU it makes the optimizer step ~5x faster
    return torch.optim.AdamW(groups, lr=lr, fused=device.type in ("cuda", "cpu"))
