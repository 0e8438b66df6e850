"""Seeded, resumable batch order. Each optimizer step has a fixed global batch of examples; micro-batches
are slices of it. So the data position is the step number alone, and a smaller micro-batch (after an
out-of-memory retry, or on resume) still sums gradients over exactly the same examples.

Epoch e shuffles with seed + e, so a resumed run sees exactly the batches the uninterrupted run would
have seen, without replaying the earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class BatchOrder:
    def __init__(self, n_examples: int, global_batch: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n_examples, seed, shuffle
        self.global_batch = min(global_batch, n_examples)  # a set smaller than a batch is one batch
        self.steps_per_epoch = n_examples // self.global_batch  # the ragged tail is dropped: fixed shapes
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
            self._epoch = epoch
        return self._order

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
