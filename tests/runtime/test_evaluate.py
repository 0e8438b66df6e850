"""Evaluation on a tiny model and a tiny data set: whole-set figures, whatever the batch size or sharding."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpuforge.models.base import BuiltModel
from gpuforge.runtime.evaluate import evaluate, to_device
from gpuforge.runtime.precision import Precision

CPU = torch.device("cpu")
FP32 = Precision("fp32", "")


class TinyImages:
    """Eleven 2x2 images of 3 classes: what evaluate needs of a data set (len and collate)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(11, 1, 2, 2, generator=generator)
        self.labels = torch.arange(11) % 3

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[indices], "labels": self.labels[indices]}


def _built() -> BuiltModel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    return BuiltModel(module, is_transformers=False, description="tiny")


def _expected(built: BuiltModel, data: TinyImages) -> dict[str, float]:
    built.module.eval()
    with torch.no_grad():
        logits = built.module(data.pixels)
    return {
        "loss": F.cross_entropy(logits, data.labels).item(),
        "accuracy": (logits.argmax(-1) == data.labels).float().mean().item(),
    }


@pytest.mark.parametrize("batch_size", [1, 4, 11, 64])
def test_the_figures_are_the_whole_sets_whatever_the_batch_size(batch_size):
    built, data = _built(), TinyImages()
    built.module.train()
    result = evaluate(built, "image-classification", data, batch_size, FP32, CPU)
    assert result == pytest.approx(_expected(built, data), rel=1e-5)
    assert not built.module.training  # eval mode: no dropout; the caller turns training back on


class HalfOfTwo:
    """Rank `rank` of two: every other example; `sum` adds the tallies the other rank recorded."""

    def __init__(self, rank: int, other: list[float] | None = None):
        self.rank, self.other, self.mine = rank, other, None

    def share(self, indices: list[int]) -> list[int]:
        return indices[self.rank :: 2]

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        self.mine = list(values)
        return [a + b for a, b in zip(values, self.other, strict=True)] if self.other else values


def test_sharded_evaluation_sums_to_the_whole_sets_figures():
    built, data = _built(), TinyImages()
    rank1 = HalfOfTwo(1)
    evaluate(built, "image-classification", data, 4, FP32, CPU, shards=rank1)
    assert rank1.mine[3] == 5  # samples: the odd indices of 11
    result = evaluate(built, "image-classification", data, 4, FP32, CPU, shards=HalfOfTwo(0, rank1.mine))
    assert result == pytest.approx(_expected(built, data), rel=1e-5)


def test_reduced_precision_evaluation_is_close_to_fp32():
    built, data = _built(), TinyImages()
    result = evaluate(built, "image-classification", data, 4, Precision("bf16", ""), CPU)
    assert result["loss"] == pytest.approx(_expected(built, data)["loss"], rel=0.05)


def test_a_cpu_batch_stays_where_it_is():
    batch = {"x": torch.zeros(2)}
    assert to_device(batch, CPU) is batch
