"""The task's forward, loss and counts on tiny modules, for plain torch models and transformers-like ones."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpuforge.models.base import BuiltModel
from gpuforge.runtime import tasks


class TinyText(nn.Module):
    """Mean of embeddings -> labels; takes the attention mask."""

    def __init__(self):
        super().__init__()
        self.embed, self.head, self.seen = nn.Embedding(10, 4), nn.Linear(4, 3), {}

    def forward(self, input_ids, attention_mask=None):
        self.seen = {"attention_mask": attention_mask}
        return self.head(self.embed(input_ids).mean(1))


class TinyTextIdsOnly(TinyText):
    def forward(self, input_ids):
        self.seen = {}
        return self.head(self.embed(input_ids).mean(1))


class KeywordModel(nn.Module):
    """A transformers-like model: keyword inputs, an output object with .logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.kwargs = None

    def forward(self, **kwargs):
        self.kwargs = sorted(kwargs)
        return SimpleNamespace(logits=self.embed(kwargs["input_ids"]))


def _text_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "labels": torch.tensor([2, 0]),
    }


def test_an_image_model_gets_the_pixels():
    module = nn.Sequential(nn.Flatten(), nn.Linear(16, 5))
    built = BuiltModel(module, is_transformers=False, description="tiny")
    pixels = torch.randn(3, 1, 4, 4)
    logits = tasks.forward(built, "image-classification", {"pixel_values": pixels, "labels": torch.zeros(3)})
    assert torch.equal(logits, module(pixels))


def test_a_plain_text_model_gets_the_mask_only_when_it_takes_one():
    batch = _text_batch()
    takes = BuiltModel(TinyText(), is_transformers=False, description="tiny")
    tasks.forward(takes, "sequence-classification", batch)
    assert torch.equal(takes.module.seen["attention_mask"], batch["attention_mask"])
    ignores = BuiltModel(TinyTextIdsOnly(), is_transformers=False, description="tiny")
    assert tasks.forward(ignores, "sequence-classification", batch).shape == (2, 3)
    assert ignores.module.seen == {}


def test_a_transformers_model_gets_keywords_and_gives_its_logits():
    built = BuiltModel(KeywordModel(), is_transformers=True, description="tiny")
    logits = tasks.forward(built, "causal-lm", _text_batch())
    assert built.module.kwargs == ["attention_mask", "input_ids"]  # labels are not passed: we compute loss
    assert logits.shape == (2, 4, 3)


def test_a_tuple_output_gives_its_first_element():
    class Pair(nn.Module):
        def forward(self, input_ids):
            return input_ids.float(), "something else"

    built = BuiltModel(Pair(), is_transformers=False, description="tiny")
    ids = torch.tensor([[1, 2]])
    assert torch.equal(tasks.forward(built, "sequence-classification", {"input_ids": ids}), ids.float())


def test_classification_loss_is_summed_in_fp32_over_samples():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]], dtype=torch.bfloat16)
    batch = {"labels": torch.tensor([0, 2])}
    loss, terms = tasks.loss_sum_and_count("sequence-classification", logits, batch)
    expected = -(F.log_softmax(logits.float(), -1)[[0, 1], [0, 2]]).sum()
    assert terms == 2 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_causal_lm_loss_predicts_each_next_token():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3], [3, 2, 1]])
    logits = torch.randn(2, 3, 5)
    loss, terms = tasks.loss_sum_and_count("causal-lm", logits, {"input_ids": ids})
    # position t predicts token t+1: (0->2, 1->3) and (0->2, 1->1)
    log_probs = F.log_softmax(logits, -1)
    expected = -(log_probs[0, 0, 2] + log_probs[0, 1, 3] + log_probs[1, 0, 2] + log_probs[1, 1, 1])
    assert terms == 4 and loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_counts_are_samples_and_real_tokens():
    images = {"pixel_values": torch.zeros(5, 1), "labels": torch.zeros(5)}
    assert tasks.count("image-classification", images) == (5, 0)
    assert tasks.count("sequence-classification", _text_batch()) == (2, 5)  # the mask's ones, not padding
    assert tasks.count("causal-lm", {"input_ids": torch.zeros(3, 7, dtype=torch.long)}) == (3, 21)


def test_the_eval_tally_gives_the_mean_loss_and_accuracy_or_perplexity():
    tally = tasks.EvalTally("sequence-classification")
    tally.add(torch.tensor([[3.0, 0.0], [0.0, 3.0]]), {"labels": torch.tensor([0, 0])})
    tally.add(torch.tensor([[0.0, 3.0]]), {"labels": torch.tensor([1])})
    result = tally.result()
    assert result["accuracy"] == pytest.approx(2 / 3)
    right = F.cross_entropy(torch.tensor([[3.0, 0.0]]), torch.tensor([0])).item()
    wrong = F.cross_entropy(torch.tensor([[0.0, 3.0]]), torch.tensor([0])).item()
    assert result["loss"] == pytest.approx((2 * right + wrong) / 3)
    lm = tasks.EvalTally("causal-lm")
    lm.add(torch.zeros(1, 3, 4), {"input_ids": torch.tensor([[0, 1, 2]])})  # uniform over 4 tokens
    assert lm.result() == pytest.approx({"loss": math.log(4), "perplexity": 4.0})
