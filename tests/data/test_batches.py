"""data.group_by_length's batch order: still every example at most once an epoch, seeded and resumable,
shuffled batch by batch, and batches of similar length (less padding)."""

import random

import pytest

from gpuforge.data.batches import BatchOrder
from gpuforge.errors import SpecError
from gpuforge.spec import parse_spec
from tests.helpers.specs import image_spec

_RNG = random.Random(0)
LENGTHS = [_RNG.randint(3, 64) for _ in range(1000)]


def _padded(order: BatchOrder, steps: int) -> int:
    return sum(max(LENGTHS[i] for i in order.batch(s)) * order.global_batch for s in range(steps))


def test_grouped_batches_cover_an_epoch_once_and_pad_less():
    grouped = BatchOrder(len(LENGTHS), 32, seed=3, lengths=LENGTHS)
    plain = BatchOrder(len(LENGTHS), 32, seed=3)
    epoch = [i for s in range(grouped.steps_per_epoch) for i in grouped.batch(s)]
    assert len(epoch) == len(set(epoch)) == 31 * 32  # the ragged tail dropped, as without grouping
    assert set(epoch) == set(plain.batch(s)[i] for s in range(31) for i in range(32))  # the same examples
    assert _padded(grouped, 31) < 0.7 * _padded(plain, 31)
    spreads = [max(LENGTHS[i] for i in b) - min(LENGTHS[i] for i in b) for b in map(grouped.batch, range(31))]
    assert max(spreads) <= 16  # neighbours in length within a run of 16 batches


def test_grouped_order_is_seeded_resumable_and_shuffled_by_batch():
    one = BatchOrder(len(LENGTHS), 32, seed=3, lengths=LENGTHS)
    again = BatchOrder(len(LENGTHS), 32, seed=3, lengths=LENGTHS)
    assert [again.batch(s) for s in (40, 5, 70)] == [one.batch(s) for s in (40, 5, 70)]  # any step, any order
    other = BatchOrder(len(LENGTHS), 32, seed=4, lengths=LENGTHS)
    assert [other.batch(s) for s in range(31)] != [one.batch(s) for s in range(31)]
    longest = [max(LENGTHS[i] for i in one.batch(s)) for s in range(31)]
    assert longest != sorted(longest)  # the batches are not walked from short to long
    assert one.batch(31) != one.batch(0)  # the next epoch is another order


def test_group_by_length_is_for_text_classification(tmp_path):
    raw = image_spec(tmp_path)
    raw["data"]["group_by_length"] = True
    with pytest.raises(SpecError, match="data.group_by_length: a image-classification job"):
        parse_spec(raw, tmp_path)
