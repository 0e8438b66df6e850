"""`torchvision:<arch>`: any torchvision classification architecture, random init (no weight downloads)."""

from __future__ import annotations

import torch
from torch import nn

from gpuforge.errors import ModelError
from gpuforge.models.base import BuiltModel, ModelRequest
from gpuforge.models.options import Rate

OPTIONS = {  # what torchvision's builders take as plain values (the rest are callables or weights)
    "dropout": Rate,
    "attention_dropout": Rate,
    "stochastic_depth_prob": Rate,
    "aux_logits": bool,
    "init_weights": bool,
    "transform_input": bool,
}


class GrayToRGB(nn.Module):
    """torchvision models expect 3 channels; repeat a single grey channel instead of failing."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x)


def options(source: str) -> dict:
    return OPTIONS


def tokenizer(source: str):
    return None


def build(request: ModelRequest) -> BuiltModel:
    if request.task != "image-classification":
        raise ModelError(f"model.task: torchvision models are for image-classification, not {request.task}")
    try:
        import torchvision
    except Exception as err:  # ImportError, or a build that does not match this torch
        raise ModelError(
            f"model.source: torchvision is not usable here ({err}); "
            "install a torchvision that matches torch: pip install 'gpuforge[vision]'"
        ) from None
    arch = request.source.partition(":")[2]
    available = torchvision.models.list_models(module=torchvision.models)
    if arch not in available:
        raise ModelError(f"model.source: unknown torchvision architecture '{arch}'")
    if request.pretrained:
        raise ModelError(
            "model.pretrained: torchvision weights are never downloaded; use hf:<dir> or python:"
        )
    module = torchvision.models.get_model(
        arch, weights=None, num_classes=request.num_labels, **request.options
    )
    return BuiltModel(GrayToRGB(module), False, f"torchvision:{arch} (random init)", {"pretrained": False})
