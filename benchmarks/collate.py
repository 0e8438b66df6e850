"""Building a text batch: gpuforge's collate (token ids kept as int32 arrays, the batch filled in numpy)
against the one it replaced (ids kept as Python lists, each row converted with torch.as_tensor), side by
side in one run.

    python benchmarks/collate.py [--batch 64] [--lengths 128,1024,8192] [--rounds 5]

For each length: a batch of --batch examples whose lengths are spread over [length/2, length] (padding
to the longest, as training does), built from the same ids by both, alternating for --rounds rounds of
0.5 s each; the median call of each, and the ratio. Both must give the same tensors (checked first).
The profile of issue 20 found this: byte-tokenized documents of ~10 kB at data.max_length 8192 spent 67 %
of a step building their batches of 64 with the list-based collate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gpuforge.data.prepare import TextClassification


def list_collate(ids: list[list[int]], labels: torch.Tensor, pad_id: int, indices: list[int]) -> dict:
    """The collate of before: Python lists of ints, converted a row at a time."""
    longest = max(len(ids[i]) for i in indices)
    input_ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, i in enumerate(indices):
        seq = ids[i]
        input_ids[row, : len(seq)] = torch.as_tensor(seq)
        mask[row, : len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels[indices]}


def timed(call, seconds: float) -> list[float]:
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", default="128,1024,8192")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"collate of {args.batch} examples: median ms a batch (rounds of 0.5 s, alternating)")
    print(f"{'length':>7} {'lists ms':>9} {'arrays ms':>10} {'speed-up':>9}")
    for length in (int(n) for n in args.lengths.split(",")):
        lists_ms, arrays_ms = compare(rng, length, args.batch, args.rounds)
        print(f"{length:>7} {lists_ms:>9.3f} {arrays_ms:>10.3f} {lists_ms / arrays_ms:>8.1f}x")


def compare(rng: np.random.Generator, length: int, batch: int, rounds: int) -> tuple[float, float]:
    """Median ms a batch of the list-based collate and of gpuforge's, on the same ids."""
    ids = [rng.integers(0, 30000, rng.integers(length // 2, length + 1)).tolist() for _ in range(batch)]
    data, indices = TextClassification(ids, np.zeros(batch, dtype=np.int64), 0), list(range(batch))
    old, new = list_collate(ids, data.labels, 0, indices), data.collate(indices)
    assert all(torch.equal(old[k], new[k]) for k in old), "the two collates differ"
    lists: list[float] = []
    arrays: list[float] = []
    for _ in range(rounds):
        lists += timed(lambda: list_collate(ids, data.labels, 0, indices), 0.5)
        arrays += timed(lambda: data.collate(indices), 0.5)
    return statistics.median(lists) * 1e3, statistics.median(arrays) * 1e3


if __name__ == "__main__":
    main()
