"""CUDA paths of compression; skipped without CUDA, run by scripts/gpu_check.sh."""

import pytest
import torch
from torch import nn

from gpuforge.compress.prune import magnitude_prune, to_semi_structured
from gpuforge.weights.quantize import quantize_model, tensor_bytes

pytestmark = pytest.mark.gpu


def test_two_of_four_runs_on_the_semi_structured_kernels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 64))
    model = model.to("cuda", torch.bfloat16).eval()
    result = magnitude_prune(model, 0.5, "2:4")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        dense = model(x)
    left = to_semi_structured(model, result.pruned)
    assert left == {}, left
    assert type(model[0].weight).__name__.startswith("SparseSemiStructured")
    with torch.inference_mode():
        sparse = model(x)
    assert torch.allclose(sparse.float(), dense.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["int8", "int8-dynamic", "int4"])
def test_quantized_linears_run_on_cuda(kind):
    torch.manual_seed(0)
    # widths in multiples of 1024: the CUDA int4 layout pads in_features up to that
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to("cuda", torch.bfloat16)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x).float()
    before = tensor_bytes(model)
    result = quantize_model(model, kind)
    assert result.quantized
    with torch.inference_mode():
        out = model(x).float()
    assert (out - expected).norm() / expected.norm() < 0.15
    assert tensor_bytes(model) < 0.7 * before
