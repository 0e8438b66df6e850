"""Seeded, resumable batch order. Each optimizer step has a fixed global batch of examples; micro-batches
are slices of it. So the data position is the step number alone, and a smaller micro-batch (after an
out-of-memory retry, or on resume) still sums gradients over exactly the same examples.

Epoch e shuffles with seed + e, so a resumed run sees exactly the batches the uninterrupted run would
have seen, without replaying the earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

GROUP_BATCHES = 16  # group_by_length sorts runs of this many batches of the shuffled order by length


class BatchOrder:
    """`lengths` (data.group_by_length): each epoch's shuffled order is cut into runs of GROUP_BATCHES
    global batches, each run sorted by length, and the epoch's batches then shuffled (seeded too): a batch
    holds examples of similar length, so per-batch padding pads little, and the order stays random."""

    def __init__(
        self,
        n_examples: int,
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        lengths: list[int] | None = None,
    ):
        self.n, self.seed, self.shuffle = n_examples, seed, shuffle
        self.global_batch = min(global_batch, n_examples)  # a set smaller than a batch is one batch
        self.steps_per_epoch = n_examples // self.global_batch  # the ragged tail is dropped: fixed shapes
        self.lengths = torch.as_tensor(lengths) if lengths is not None else None
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
            if self.lengths is not None:
                self._order = self._grouped(self._order, g)
            self._epoch = epoch
        return self._order

    def _grouped(self, order: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        run = GROUP_BATCHES * self.global_batch
        order = order[: self.steps_per_epoch * self.global_batch]  # the tail dropped at random, as ungrouped
        runs = [chunk[torch.argsort(self.lengths[chunk], stable=True)] for chunk in order.split(run)]
        batches = torch.cat(runs).view(-1, self.global_batch)
        return batches[torch.randperm(len(batches), generator=g)].flatten()

    def batch(self, step_index: int) -> list[int]:
        """Example indices of the global batch of optimizer step `step_index` (0-based)."""
        epoch, within = divmod(step_index, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        return order[within * self.global_batch : (within + 1) * self.global_batch].tolist()


def micro_batches(indices: list[int], micro: int) -> list[list[int]]:
    return [indices[i : i + micro] for i in range(0, len(indices), micro)]


def eval_batches(n_examples: int, batch_size: int) -> Iterator[list[int]]:
    """Every example once, in order, the last batch possibly smaller."""
    for start in range(0, n_examples, batch_size):
        yield list(range(start, min(start + batch_size, n_examples)))
