"""CPU dropout from numpy's SFC64, seeded from torch: right statistics, same masks on replay."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from gpuforge.train.fast_dropout import _attention_with_fast_dropout, fast_dropout, use_fast_dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drops_the_asked_share_and_keeps_the_mean(p):
    torch.manual_seed(0)
    out = fast_dropout(torch.ones(1_000_000), p)
    assert (out == 0).float().mean().item() == pytest.approx(p, abs=0.002)
    assert out.mean().item() == pytest.approx(1.0, abs=0.01)
    kept = out[out != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-4)


def test_masks_follow_torch_seed_and_differ_between_calls():
    x = torch.ones(64, 64)
    torch.manual_seed(3)
    first, second = fast_dropout(x, 0.3), fast_dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(fast_dropout(x, 0.3), first)
    assert not torch.equal(first, second)


def test_edge_probabilities_and_in_place():
    x = torch.randn(10, 10)
    assert fast_dropout(x, 0.0) is x
    assert torch.count_nonzero(fast_dropout(x, 1.0)) == 0
    y = x.clone()
    out = fast_dropout(y, 0.5, inplace=True)
    assert out is y and torch.count_nonzero(y) < 100
    with pytest.raises(ValueError, match="between 0 and 1"):
        fast_dropout(x, 1.5)


def test_hooked_dropout_draws_fast_masks_in_training_and_nothing_in_eval():
    layer, x = nn.Dropout(0.2), torch.randn(32, 16)
    torch.manual_seed(1)
    torchs = layer(x)
    assert use_fast_dropout(layer) == 1
    torch.manual_seed(1)
    routed = layer(x)
    torch.manual_seed(1)
    assert torch.equal(routed, fast_dropout(x, 0.2)) and not torch.equal(routed, torchs)
    layer.eval()
    assert torch.equal(layer(x), x)
    assert not _get_current_function_mode_stack()  # the mode is off outside the hooked modules


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        self.dropout(x)
        raise torch.OutOfMemoryError("injected")


def test_the_mode_is_left_when_a_hooked_forward_raises():
    """An out-of-memory step is retried by the engine: a mode left on would leak into everything after."""
    model = Raises()
    use_fast_dropout(model)
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.randn(4, 4))
    assert not _get_current_function_mode_stack()


@pytest.mark.parametrize("case", ["bool-mask", "float-mask", "causal", "gqa"])
def test_attention_math_matches_torch_without_dropout(case):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    kwargs = {}
    if case == "bool-mask":
        kwargs["attn_mask"] = torch.rand(2, 1, 5, 7) > 0.3
        kwargs["attn_mask"][..., 0] = True  # no fully masked row
    elif case == "float-mask":
        kwargs["attn_mask"] = torch.randn(2, 1, 5, 7)
    elif case == "causal":
        q, kwargs["is_causal"] = torch.randn(2, 4, 7, 8), True
    else:
        k, v, kwargs["enable_gqa"] = k[:, :2], v[:, :2], True
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.allclose(_attention_with_fast_dropout(q, k, v, **kwargs), expected, atol=1e-5)


class Attention(nn.Module):
    """Like an HF attention block: it owns a Dropout and hands its p to SDPA."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout.p if self.training else 0.0)


def test_a_module_owning_dropout_gets_fast_attention_dropout_and_gradients_flow():
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    attention = Attention()
    use_fast_dropout(attention)
    torch.manual_seed(5)
    out = attention(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(out, _attention_with_fast_dropout(q, k, v, dropout_p=0.5))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_the_same_masks(reentrant):
    """A recomputed block that drew other masks would give other gradients, silently."""
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 16), nn.Dropout(0.3))
    use_fast_dropout(block)
    x = torch.randn(8, 16, requires_grad=True)

    def grads(use_checkpoint: bool):
        block.zero_grad()
        x.grad = None
        torch.manual_seed(11)
        out = checkpoint(block, x, use_reentrant=reentrant) if use_checkpoint else block(x)
        out.pow(2).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    for plain, recomputed in zip(grads(False), grads(True), strict=True):
        assert torch.allclose(plain, recomputed, atol=1e-6)
