"""Layers that channel pruning made narrower: a freshly built model takes the saved shapes before its weights
load (artifact/), as compress/prune.py records them."""

from __future__ import annotations

import torch
from torch import nn


def is_conv1d(layer: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a Linear with its weight stored (in, out)."""
    return type(layer).__name__ == "Conv1D" and hasattr(layer, "nf")


def apply_resized(module: nn.Module, resized: dict[str, dict[str, int]]) -> None:
    """Give a freshly built model the shapes a channel-pruned one was saved with (before loading weights)."""
    for name, fields in resized.items():
        layer = module.get_submodule(name)
        if "num_features" in fields:
            n = fields["num_features"]
            layer.weight, layer.bias = nn.Parameter(torch.empty(n)), nn.Parameter(torch.empty(n))
            layer.running_mean, layer.running_var = torch.zeros(n), torch.ones(n)
            layer.num_features = n
            continue
        for key, value in fields.items():
            setattr(layer, key, value)
        if isinstance(layer, nn.Conv2d):
            shape = (layer.out_channels, layer.in_channels, *layer.kernel_size)
            bias_size = layer.out_channels
        elif is_conv1d(layer):
            shape, bias_size = (layer.nx, layer.nf), layer.nf
        else:
            shape, bias_size = (layer.out_features, layer.in_features), layer.out_features
        layer.weight = nn.Parameter(torch.empty(shape))
        if layer.bias is not None:
            layer.bias = nn.Parameter(torch.empty(bias_size))
