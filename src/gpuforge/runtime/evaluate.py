"""Evaluation over a held-out set, the same for a training run, a compressed variant and a served model."""

from __future__ import annotations

from typing import Protocol

import torch

from gpuforge.data.batches import micro_batches
from gpuforge.hardware.probe import is_out_of_memory, release_memory
from gpuforge.runtime import tasks
from gpuforge.runtime.precision import autocast


class Shards(Protocol):
    """Data-parallel ranks that each evaluate their share of a set and sum what they found."""

    def share(self, indices: list[int]) -> list[int]: ...

    def sum(self, values: list[float], device: torch.device) -> list[float]: ...


EVAL_BATCH_FACTOR = 4  # examples an evaluation forward takes, per training micro-batch example


def eval_batch_size(micro: int, examples: int, processes: int = 1) -> int:
    """The evaluation's batch during training: no gradients and no activations kept for a backward, so
    several times the training micro-batch fits in what the step used (an out-of-memory error halves it).
    Several processes keep the micro-batch: a retry in one alone would part them."""
    factor = EVAL_BATCH_FACTOR if processes == 1 else 1
    return max(1, min(examples, factor * micro))


def evaluate(
    built,
    task: str,
    data,
    batch_size: int,
    precision,
    device: torch.device,
    shards: Shards | None = None,
    indices: list[int] | None = None,
    retry: bool = True,
) -> dict[str, float]:
    """Loss and accuracy (classification) or perplexity (causal-lm) over the eval set (or `indices` of it).

    In inference mode, examples of similar length batched together (the sum does not depend on the order;
    each batch is padded to its longest, so sorted batches pad least). Out of memory, the pass starts over
    in batches half as big (`retry`: one process only). `shards` (DDP's ranks): each rank evaluates its
    slice of the set and the tallies are summed (so eval time does not count against the other ranks'
    collective timeout). Without it (one process, or FSDP, where every forward needs all the shards) every
    batch runs here."""
    chosen = list(range(len(data))) if indices is None else indices
    mine = shards.share(chosen) if shards is not None else chosen
    lengths = getattr(data, "lengths", None)
    if lengths is not None:
        mine = sorted(mine, key=lengths.__getitem__)
    built.module.eval()
    while True:
        try:
            tally = _tally(built, task, data, mine, batch_size, precision, device)
            break
        except Exception as err:
            if batch_size == 1 or not retry or shards is not None or not is_out_of_memory(err):
                raise  # several processes (DDP's shards, FSDP's gathers): a retry in one alone parts them
        release_memory(device)
        batch_size //= 2
    if shards is not None:
        tally.loss, tally.terms, tally.correct, tally.samples = shards.sum(
            [tally.loss, tally.terms, tally.correct, tally.samples], device
        )
    return tally.result()


def _tally(built, task: str, data, indices: list[int], batch_size: int, precision, device: torch.device):
    tally = tasks.EvalTally(task)
    with torch.inference_mode():
        for chunk in micro_batches(indices, batch_size):
            batch = to_device(data.collate(chunk), device)
            with autocast(precision, device):
                logits = tasks.forward(built, task, batch)
            tally.add(logits, batch)
    return tally


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
