"""The model as the training loop drives it across processes: plain, DDP, or FSDP2-sharded.

    parallel = wrap(built.module, spec.distributed, ranks, device)    # before the optimizer is made
    with parallel.accumulating(last=is_last_micro_batch): loss.backward()
    record.update(parallel.pop_comm())                                 # comm_bytes of this step

DDP keeps a whole replica a process and all-reduces the gradients once a step (not once a micro-batch:
`accumulating` holds the sync back until the last one), through one of our compression hooks, which also
count the bytes. FSDP shards parameters, gradients and optimizer state; its traffic is all-gathers and
reduce-scatters that torch issues itself, so it has no hook and no byte count.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from gpuforge.distributed.grad_compression import CompressionState, make_hook
from gpuforge.distributed.ranks import Ranks
from gpuforge.runtime.memory import optimizer_state_bytes


@dataclass
class Parallel:
    strategy: str  # "none" | "ddp" | "fsdp"
    ranks: Ranks
    model: torch.nn.Module  # the model itself (sharded in place by FSDP): what checkpoints and eval read
    forward_module: torch.nn.Module  # what training calls: the DDP wrapper, else the model
    hook_state: CompressionState | None = None

    @contextmanager
    def accumulating(self, last: bool):
        """Backward of one micro-batch; gradients are synchronised only after the last of the step."""
        if last or self.strategy == "none":
            yield
        elif self.strategy == "ddp":
            with self.forward_module.no_sync():
                yield
        else:
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    def full_states(self, optimizer) -> tuple[dict, dict] | None:
        """FSDP: the whole model's and optimizer's state, gathered to rank 0 (every rank must call it; the
        others get empty ones). None for DDP and one process: their module holds the whole already."""
        if self.strategy != "fsdp":
            return None
        from gpuforge.distributed.fsdp import full_state_dicts

        return full_state_dicts(self.model, optimizer)

    def held_bytes(self, optimizer) -> dict[str, int]:
        """Bytes this process holds for parameters, gradients and optimizer state: FSDP's shards, or the
        whole for DDP and one process."""
        if self.strategy == "fsdp":
            from gpuforge.distributed.fsdp import local_bytes

            return local_bytes(self.model, optimizer)
        params = list(self.model.parameters())
        return {
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": optimizer_state_bytes(optimizer),
        }

    def pop_comm(self) -> dict[str, int]:
        """Bytes this rank handed to all-reduces since the last call (once a step), with compression and
        without; empty when nothing counts them (one process, FSDP)."""
        if self.hook_state is None:
            return {}
        counts = self.hook_state.counter.pop()
        return {
            "comm_bytes": counts["comm_bytes"],
            "comm_bytes_uncompressed": counts["comm_bytes_uncompressed"],
        }


def wrap(module: torch.nn.Module, options, ranks: Ranks, device: torch.device, seed: int = 0) -> Parallel:
    """`options` is the spec's `distributed` section. One process, or strategy none: the model as it is."""
    strategy = options.strategy if ranks.distributed else "none"
    if strategy == "ddp":
        ddp = _ddp(module, device)
        hook, state = make_hook(
            options.gradient_compression,
            rank=options.powersgd_rank,
            start_iter=options.powersgd_start_step,
            seed=seed,
        )
        ddp.register_comm_hook(state, hook)
        return Parallel("ddp", ranks, module, ddp, state)
    if strategy == "fsdp":
        from gpuforge.distributed.fsdp import shard_model

        sharded = shard_model(module, device)
        return Parallel("fsdp", ranks, sharded, sharded)
    return Parallel("none", ranks, module, module)


def _ddp(module: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    # Buffers are not trained and every rank built the same ones: no broadcast before each forward (an
    # uncounted collective a micro-batch). Newer torch names the switch forward_sync_buffers.
    device_ids = [device.index] if device.type == "cuda" else None
    try:
        return DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)
    except TypeError:
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)
