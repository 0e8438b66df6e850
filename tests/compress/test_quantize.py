"""Post-training quantization with torchao: accuracy, memory, skipping, exact save/load, clear errors."""

import sys

import pytest
import torch
from torch import nn

from gpuforge.errors import GpuforgeError
from gpuforge.weights.quantize import (
    QUANT_KINDS,
    load_quantized,
    quantize_model,
    save_quantized,
    tensor_bytes,
)
from gpuforge.weights.weight_only import QuantizedLinear

# kind -> (max relative error of the outputs, bytes of a quantized weight / its fp32 bytes: low, high).
# Relative errors measured on the MLP below over seeds 0-9 (torchao 0.18, CPU): int8 0.005-0.007,
# int8-dynamic 0.009-0.011, int4 0.07-0.085; bytes: int8 0.26-0.27 (int8 rows + a scale and zero point per
# row), int4 0.156 (two weights a byte + a bfloat16 scale and zero point per group of 32).
BOUNDS = {
    "int8": (0.015, 0.25, 0.30),
    "int8-dynamic": (0.025, 0.25, 0.30),
    "int4": (0.15, 0.125, 0.20),
}


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).eval()


class _Odd(nn.Module):
    """A layer no 4-bit group fits (20 inputs), a middle layer, and a small head a user may keep in float."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(20, 64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


def _weight_bytes(linear: nn.Linear) -> int:
    return tensor_bytes(linear) - linear.bias.numel() * linear.bias.element_size()


def _is_quantized(weight: torch.Tensor) -> bool:
    return type(weight) not in (torch.Tensor, nn.Parameter)


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quantized_outputs_stay_close_and_weights_shrink(kind):
    model = _mlp()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(x)
    fp32 = {name: model[int(name)].weight.numel() * 4 for name in ("0", "2")}
    total_before = tensor_bytes(model)

    result = quantize_model(model, kind)

    assert result.kind == kind and result.quantized == ["0", "2"] and result.skipped == {}
    assert _is_quantized(model[0].weight) and _is_quantized(model[2].weight)
    with torch.inference_mode():
        out = model(x)
    assert out.dtype == torch.float32  # int4 computes in bfloat16 on CPU, but the model sees float32
    max_rel, low, high = BOUNDS[kind]
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < max_rel, rel
    for name, before in fp32.items():
        ratio = _weight_bytes(model[int(name)]) / before
        assert low <= ratio <= high, (name, ratio)
    assert tensor_bytes(model) < high * total_before + 4 * (128 + 16)


def test_tensor_bytes_of_a_float_model_counts_each_tensor_once():
    model = _mlp()
    assert tensor_bytes(model) == 4 * (64 * 128 + 128 + 128 * 16 + 16)
    tied = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
    tied["b"].weight = tied["a"].weight
    assert tensor_bytes(tied) == 4 * (64 + 8 + 8)
    bn = nn.BatchNorm1d(8)  # buffers count too: running mean, var (fp32) and the int64 batch counter
    assert tensor_bytes(bn) == 4 * 8 * 4 + 8


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_skip_by_name_and_by_shape(kind):
    model = _Odd()
    head_before = model.head.weight.detach().clone()

    result = quantize_model(model, kind, skip=["head"])

    assert result.skipped == {"head": "skipped on request"}
    assert result.quantized == ["inp", "body.0"]
    assert _is_quantized(model.body[0].weight)
    # 20 inputs fit no 4-bit group of torchao's kernel: our weight-only int4 takes the layer instead
    assert isinstance(model.inp, QuantizedLinear) if kind == "int4" else _is_quantized(model.inp.weight)
    assert type(model.head.weight) is nn.Parameter and torch.equal(model.head.weight, head_before)
    with torch.inference_mode():
        assert model(torch.randn(5, 20)).shape == (5, 3)


def test_shapes_the_4bit_kernel_cannot_take_get_weight_only_int4():
    model, x = _Odd(), torch.randn(5, 20)
    expected = model(x).detach()
    result = quantize_model(model, "int4")
    assert result.quantized == ["inp", "body.0", "head"] and result.skipped == {}
    assert isinstance(model.inp, QuantizedLinear) and isinstance(model.head, QuantizedLinear)  # 20 in, 3 out
    with torch.inference_mode():
        out = model(x)
    assert (out - expected).norm() / expected.norm() < 0.15


def test_layers_with_a_tiny_share_of_the_weights_stay_in_float():
    model = nn.Sequential(nn.Embedding(4, 8), nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512))
    result = quantize_model(model, "int8")
    assert result.quantized == ["1", "3"]
    assert result.skipped == {"0": "its kind and shape hold 0.01% of the weights (< 1%): kept in float"}


def test_many_small_layers_of_one_shape_count_together():
    blocks = [nn.Linear(64, 64) for _ in range(8)]  # each 0.9% of the weights, 7.7% together
    model = nn.Sequential(*blocks, nn.Linear(64, 64 * 12 * 16), nn.Linear(64 * 12 * 16, 64))
    result = quantize_model(model, "int8")
    assert result.skipped == {} and len(result.quantized) == 10


def test_a_parent_name_in_skip_keeps_its_whole_subtree_in_float():
    model = _Odd()
    result = quantize_model(model, "int8", skip=["body"])
    assert result.quantized == ["inp", "head"]
    assert result.skipped == {"body.0": "skipped on request"}


def test_layers_torchao_cannot_swap_are_skipped_with_the_reason():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "emb": nn.Embedding(10, 16),
            "lm_head": nn.Linear(16, 10, bias=False),
            "layer": nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True),
        }
    ).eval()
    model["lm_head"].weight = model["emb"].weight  # tied, as in language models

    result = quantize_model(model, "int8")

    assert result.skipped == {
        "lm_head": "weight tied to emb",
        "emb": "weight tied to lm_head",  # weight_only.py leaves the tied table alone too
        "layer.self_attn.out_proj": "inside nn.MultiheadAttention, which reads the float weight directly",
    }
    assert result.quantized == ["layer.linear1", "layer.linear2"]
    assert model["lm_head"].weight is model["emb"].weight
    with torch.inference_mode():
        assert model["layer"](torch.randn(2, 5, 32)).shape == (2, 5, 32)
    # a second call finds nothing left to do and says why
    again = quantize_model(model, "int8")
    assert again.quantized == []
    assert again.skipped["layer.linear1"] == "weight is already a Int8Tensor"


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_save_then_load_into_a_fresh_float_model_gives_identical_outputs(kind, tmp_path):
    model = _Odd(seed=0)
    quantize_model(model, kind, skip=["head"])
    x = torch.randn(7, 20, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = model(x)
    path = tmp_path / "model.pt"
    save_quantized(model, path)

    fresh = _Odd(seed=1)  # other float weights: only what is loaded can make the outputs equal
    with torch.inference_mode():
        assert not torch.allclose(fresh(x), expected)
    result = load_quantized(fresh, kind, path, skip=["head"])

    assert result.quantized == [n for n in ("inp", "body.0") if n not in result.skipped]
    with torch.inference_mode():
        assert torch.equal(fresh(x), expected)


def test_loading_with_another_kind_or_skip_list_is_refused(tmp_path):
    model = _mlp()
    quantize_model(model, "int8")
    path = tmp_path / "model.pt"
    save_quantized(model, path)
    with pytest.raises(GpuforgeError, match=r"0\.weight was saved as Int8Tensor.*kind 'int4'"):
        load_quantized(_mlp(), "int4", path)
    with pytest.raises(GpuforgeError, match=r"2\.weight was saved as Int8Tensor.*makes it Tensor"):
        load_quantized(_mlp(), "int8", path, skip=["2"])
    with pytest.raises(GpuforgeError, match="not found"):
        load_quantized(_mlp(), "int8", tmp_path / "missing.pt")
    with pytest.raises(GpuforgeError, match="does not fit this model as quantized with kind 'int8'"):
        load_quantized(_mlp().to(torch.bfloat16), "int8", path)  # saved from float32
    torch.save({"0.weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(GpuforgeError, match="not a gpuforge quantized-weights file"):
        load_quantized(_mlp(), "int8", tmp_path / "other.pt")


def test_unknown_kind_or_skip_name_raises_a_clear_error():
    model = _mlp()
    with pytest.raises(GpuforgeError, match=r"unknown quantization kind 'int3': choose one of int8, int4"):
        quantize_model(model, "int3")
    with pytest.raises(GpuforgeError, match="no module named 'classifier'"):
        quantize_model(model, "int8", skip=["classifier"])
    assert type(model[0].weight) is nn.Parameter  # nothing was touched


def test_missing_torchao_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise ImportError
    with pytest.raises(GpuforgeError, match=r"'int8-dynamic' needs torchao.*pip install torchao"):
        quantize_model(_mlp(), "int8-dynamic")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quantize_and_reload_on_cuda(kind, tmp_path):
    model = _mlp().cuda()
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        ref = model(x)
    result = quantize_model(model, kind)
    assert result.quantized == ["0", "2"], result.skipped
    with torch.inference_mode():
        out = model(x)
    assert out.dtype == ref.dtype
    assert ((out - ref).norm() / ref.norm()).item() < BOUNDS[kind][0]
    save_quantized(model, tmp_path / "m.pt")
    fresh = _mlp(seed=1).cuda()
    load_quantized(fresh, kind, tmp_path / "m.pt")
    with torch.inference_mode():
        assert torch.equal(fresh(x), out)


def _small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.Flatten())


@pytest.mark.parametrize("kind, most", [("int8", 0.3), ("int4", 0.2)])
@pytest.mark.parametrize(
    "build, x", [(_small_cnn, torch.randn(2, 1, 8, 8)), (lambda: nn.Sequential(nn.Embedding(1000, 64)), None)]
)
def test_embeddings_and_convolutions_are_quantized_too_and_reload_exactly(tmp_path, kind, most, build, x):
    """A small CNN and a token table hold most of their bytes outside nn.Linear."""
    x = torch.randint(0, 1000, (3, 7)) if x is None else x
    torch.manual_seed(0)
    model = build().eval()
    before, expected = tensor_bytes(model), model(x).detach()
    result = quantize_model(model, kind)
    assert result.quantized and not result.skipped
    assert tensor_bytes(model) <= most * before
    out = model(x).detach()
    assert (out - expected).norm() / expected.norm() < (0.02 if kind == "int8" else 0.15)
    save_quantized(model, tmp_path / "q.pt")
    torch.manual_seed(1)  # a rebuilt float model with other values: loading must overwrite them all
    fresh = build().eval()
    load_quantized(fresh, kind, tmp_path / "q.pt")
    assert torch.equal(fresh(x), out)
