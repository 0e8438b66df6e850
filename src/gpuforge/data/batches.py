"""Seeded, resumable batch order: the data position is one integer (micro-batches consumed so far).

Epoch e shuffles with seed + e, so a resumed run sees exactly the batches the uninterrupted run would
have seen, without replaying the earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class BatchOrder:
    def __init__(self, n_examples: int, batch_size: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n_examples, seed, shuffle
        self.batch_size = min(batch_size, n_examples)  # a set smaller than a batch is one batch
        self.batches_per_epoch = n_examples // self.batch_size  # drop the ragged tail: shapes stay fixed
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
            self._epoch = epoch
        return self._order

    def batch(self, position: int) -> list[int]:
        """Example indices of the micro-batch at this global position."""
        epoch, within = divmod(position, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        return order[within * self.batch_size : (within + 1) * self.batch_size].tolist()

    def iterate(self, start: int) -> Iterator[tuple[int, list[int]]]:
        position = start
        while True:
            yield position, self.batch(position)
            position += 1


def eval_batches(n_examples: int, batch_size: int) -> Iterator[list[int]]:
    """Every example once, in order, the last batch possibly smaller."""
    for start in range(0, n_examples, batch_size):
        yield list(range(start, min(start + batch_size, n_examples)))
