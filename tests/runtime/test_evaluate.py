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


def test_indices_evaluate_those_examples_only():
    built, data = _built(), TinyImages()
    result = evaluate(built, "image-classification", data, 4, FP32, CPU, indices=[0, 3, 5, 8])
    sample = TinyImages()
    sample.pixels, sample.labels = data.pixels[[0, 3, 5, 8]], data.labels[[0, 3, 5, 8]]
    assert result == pytest.approx(_expected(built, sample), rel=1e-5)


class GradSpy(nn.Module):
    """Records whether autograd was on in its forwards, and fails the first forward over `oom_above`."""

    def __init__(self, oom_above: int | None = None):
        super().__init__()
        self.inner, self.grad_modes, self.sizes, self.oom_above = _built().module, [], [], oom_above

    def forward(self, x):
        self.grad_modes.append(torch.is_grad_enabled() or not torch.is_inference_mode_enabled())
        self.sizes.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            self.oom_above = None
            raise torch.OutOfMemoryError("injected")
        return self.inner(x)


def test_evaluation_runs_in_inference_mode_and_halves_its_batch_out_of_memory():
    spy, data = GradSpy(oom_above=4), TinyImages()
    built = BuiltModel(spy, is_transformers=False, description="spy")
    result = evaluate(built, "image-classification", data, 8, FP32, CPU)
    assert not any(spy.grad_modes)  # inference mode, autograd off, in every forward
    assert spy.sizes == [8, 4, 4, 3]  # the pass started over at half the batch
    assert result == pytest.approx(_expected(BuiltModel(spy.inner, False, "tiny"), data), rel=1e-5)


class TextOfLengths:
    """Token sequences of different lengths, padded per batch as data/prepare.py's TextClassification."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.labels = torch.arange(len(lengths)) % 2
        self.seen: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        self.seen.append([self.lengths[i] for i in indices])
        longest = max(self.lengths[i] for i in indices)
        ids = torch.zeros(len(indices), longest, dtype=torch.long)
        mask = torch.zeros(len(indices), longest, dtype=torch.long)
        for row, i in enumerate(indices):
            ids[row, : self.lengths[i]] = 1 + i
            mask[row, : self.lengths[i]] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": self.labels[indices]}


class MeanOfEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(20, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))


def test_text_is_batched_by_length_with_the_same_figures():
    data = TextOfLengths([9, 1, 8, 2, 7, 3, 6, 4])
    built = BuiltModel(MeanOfEmbeddings(), is_transformers=False, description="text")
    by_length = evaluate(built, "sequence-classification", data, 2, FP32, CPU)
    assert data.seen == [[1, 2], [3, 4], [6, 7], [8, 9]]  # least padding: neighbours in length
    one_batch = evaluate(built, "sequence-classification", data, 8, FP32, CPU)
    assert by_length == pytest.approx(one_batch, rel=1e-6)
