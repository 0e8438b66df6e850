"""Pruning on tiny models: the share asked for goes, the head stays, shrunk layers rebuild the same."""

import pytest
import torch
from torch import nn

from gpuforge.compress.prune import (
    PruneError,
    magnitude_prune,
    prune_channels,
    to_semi_structured,
    weight_layers,
)
from gpuforge.models import ModelRequest, build_model
from gpuforge.weights.resize import apply_resized


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 5))


def cnn() -> nn.Module:
    """The shape of examples/models/digits_cnn.py: conv-bn-relu twice, pool, flatten, linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip


def tiny_bert():
    return build_model(
        ModelRequest(
            "bundled:minilm",
            "sequence-classification",
            num_labels=3,
            pretrained=False,
            options={
                "num_hidden_layers": 2,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        )
    ).module.eval()


@pytest.mark.parametrize("amount", [0.3, 0.5, 0.9])
def test_unstructured_zeroes_the_share_in_every_layer_but_the_head(amount):
    model = mlp()
    head_before = model[4].weight.clone()
    result = magnitude_prune(model, amount)
    assert result.pruned == ["0", "2"]
    for layer in (model[0], model[2]):
        assert (layer.weight == 0).float().mean().item() == pytest.approx(amount, abs=0.01)
    assert torch.equal(model[4].weight, head_before)
    # the smallest weights went: every kept weight is at least as large as every removed one
    original = mlp()[0].weight.abs()
    kept = model[0].weight != 0
    assert original[kept].min() >= original[~kept].max()
    assert torch.equal(result.masks["0.weight"], kept)


def test_two_of_four_keeps_the_two_largest_of_each_group_and_skips_odd_widths():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 6), nn.Linear(6, 2))
    original = model[0].weight.detach().clone()
    result = magnitude_prune(model, 0.5, "2:4")
    groups = model[0].weight.reshape(8, 4, 4)
    assert ((groups != 0).sum(-1) == 2).all()
    top2 = original.abs().reshape(8, 4, 4).topk(2, dim=-1).values.min(-1).values
    assert (groups.abs().max(-1).values >= top2 - 1e-7).all()
    assert result.pruned == ["0", "1"] and result.skipped == {}
    assert model[2].weight.count_nonzero() == model[2].weight.numel()  # the head


def test_two_of_four_on_a_width_not_divisible_by_four_is_skipped_and_said():
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    result = magnitude_prune(model, 0.5, "2:4")
    assert result.skipped == {"0": "input width 6 is not a multiple of 4"} and result.pruned == ["1"]


@pytest.mark.parametrize("amount", [-0.1, 1.0, 1.5])
def test_a_sparsity_outside_zero_one_is_refused(amount):
    with pytest.raises(PruneError, match=r"sparsity must be in \[0, 1\)"):
        magnitude_prune(mlp(), amount)


@pytest.mark.parametrize("build, x", [(mlp, torch.randn(4, 16)), (cnn, torch.randn(4, 1, 8, 8))])
def test_channel_pruning_shrinks_layers_and_a_rebuilt_model_loads_the_weights(build, x):
    model = build().eval()
    before = sum(p.numel() for p in model.parameters())
    result = prune_channels(model, 0.5)
    assert len(result.pruned) == 2  # both hidden widths, the head's outputs untouched
    assert sum(p.numel() for p in model.parameters()) < 0.6 * before
    out = model(x)
    assert out.shape[-1] in (5, 10)
    rebuilt = build()
    apply_resized(rebuilt, result.resized)
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(rebuilt.eval()(x), out)


def test_channel_pruning_keeps_the_units_that_matter():
    """A hidden unit that nothing reads is the first to go: the output does not change at all."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight[:, 4:] = 0  # units 4..7 are never read
    x = torch.randn(3, 4)
    expected = model(x)
    prune_channels(model, 0.5, multiple_of=1)
    assert model[0].out_features == 4 and torch.allclose(model(x), expected)


def test_channel_pruning_of_a_transformer_ffn_updates_its_config():
    model = tiny_bert()
    ids = torch.randint(5, 100, (2, 7))
    result = prune_channels(model, 0.3)
    assert result.config == {"intermediate_size": 44} and model.config.intermediate_size == 44  # 64 x 0.7
    assert [n for n in result.pruned] == [f"bert.encoder.layer.{i}.output.dense" for i in range(2)]
    assert model(input_ids=ids).logits.shape == (2, 3)


def test_channel_pruning_without_pairs_says_what_it_knows():
    with pytest.raises(PruneError, match="transformer FFNs"):
        prune_channels(nn.Sequential(nn.Linear(4, 2)), 0.5)


def test_the_head_is_the_last_linear_like_layer():
    assert [n for n, _ in weight_layers(cnn())] == ["0", "3"]


@pytest.mark.parametrize(
    "width, amount, kept", [(1536, 0.3, 1072), (1536, 0.5, 768), (64, 0.3, 44), (32, 0.9, 3)]
)
def test_at_least_the_asked_share_of_units_goes(width, amount, kept):
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2), nn.ReLU(), nn.Linear(2, 2))
    prune_channels(model, amount)
    assert model[0].out_features == kept and model[2].in_features == kept


def test_semi_structured_kernels_are_cuda_only_and_say_so():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    result = magnitude_prune(model, 0.5, "2:4")
    assert to_semi_structured(model, result.pruned) == {
        "0": "semi-structured sparse kernels run on CUDA only"
    }
    assert type(model[0].weight) is nn.Parameter
