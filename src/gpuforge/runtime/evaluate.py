"""Evaluation over a held-out set, the same for a training run, a compressed variant and a served model."""

from __future__ import annotations

from typing import Protocol

import torch

from gpuforge.data.batches import micro_batches
from gpuforge.runtime import tasks
from gpuforge.runtime.precision import autocast


class Shards(Protocol):
    """Data-parallel ranks that each evaluate their share of a set and sum what they found."""

    def share(self, indices: list[int]) -> list[int]: ...

    def sum(self, values: list[float], device: torch.device) -> list[float]: ...


def evaluate(
    built, task: str, data, batch_size: int, precision, device: torch.device, shards: Shards | None = None
) -> dict[str, float]:
    """Loss and accuracy (classification) or perplexity (causal-lm) over the whole eval set.

    `shards` (DDP's ranks): each rank evaluates its slice of the set and the tallies are summed (so eval
    time does not count against the other ranks' collective timeout). Without it (one process, or FSDP,
    where every forward needs all the shards) every batch runs here."""
    built.module.eval()
    tally = tasks.EvalTally(task)
    everything = list(range(len(data)))
    mine = shards.share(everything) if shards is not None else everything
    with torch.no_grad():
        for chunk in micro_batches(mine, batch_size):
            batch = to_device(data.collate(chunk), device)
            with autocast(precision, device):
                logits = tasks.forward(built, task, batch)
            tally.add(logits, batch)
    if shards is not None:
        tally.loss, tally.terms, tally.correct, tally.samples = shards.sum(
            [tally.loss, tally.terms, tally.correct, tally.samples], device
        )
    return tally.result()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
