"""A QLoRA base: nn.Linear layers swapped for bitsandbytes 4-bit (nf4) or 8-bit layers, and back.

Training quantizes the base (train/setup.py); loading an adapter rebuilds the same base (artifact/), and
merging it dequantizes that base first (weights/merge.py): one definition for all three.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuforge.errors import SpecError
from gpuforge.models.base import BuiltModel, name_matches

KEEP_FULL = ("classifier", "score", "lm_head")  # heads stay full precision (lm_head is often tied)


def quantize_base(
    built: BuiltModel, kind: str, keep_full: list[str], compute_dtype: torch.dtype
) -> BuiltModel:
    """Swap the base's nn.Linear layers for bitsandbytes 4-bit (nf4) or 8-bit layers, frozen.

    The weights are quantized when the model moves to its device (`.to(device)`, CPU included); LoRA
    (applied next) trains beside them. Heads and modules_to_save stay in full precision."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise SpecError(
            "adapt.quantize_base: needs bitsandbytes, which is not installed (pip install 'gpuforge[qlora]')"
        ) from None
    skip = list(KEEP_FULL) + list(keep_full)
    replaced = 0
    for name, child in list(built.module.named_modules()):
        if not isinstance(child, nn.Linear) or any(
            name_matches(name, s) or name.startswith(s + ".") for s in skip
        ):
            continue
        bias = child.bias is not None
        if kind == "nf4":
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=bias,
                compute_dtype=compute_dtype,
                quant_type="nf4",
            )
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
            # On CPUs with AVX512-BF16, bitsandbytes repacks the weight in place the first time the layer
            # runs in eval mode; seen with 0.50.2: that repacking fails on layers narrower than its
            # 32-wide tiles, and a run evaluates mid-training. The plain dequantize path works everywhere.
            layer.support_avx512bf16_for_cpu = False
        else:
            layer = bnb.nn.Linear8bitLt(
                child.in_features, child.out_features, bias=bias, has_fp16_weights=False
            )
            layer.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
        if bias:
            layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
        parent_name, _, attr = name.rpartition(".")
        setattr(built.module.get_submodule(parent_name) if parent_name else built.module, attr, layer)
        replaced += 1
    if not replaced:
        raise SpecError("adapt.quantize_base: the model has no nn.Linear layer to quantize")
    for p in built.module.parameters():
        p.requires_grad_(False)  # the base is frozen; LoRA adds what trains
    built.description += f", base quantized {kind} ({replaced} linear layers)"
    built.extra["quantize_base"] = kind
    return built


def is_quantized_linear(layer: nn.Module) -> bool:
    return type(layer).__name__ in ("Linear4bit", "Linear8bitLt") and type(layer).__module__.startswith(
        "bitsandbytes"
    )


def dequantize_linears(module: nn.Module) -> int:
    """Replace bitsandbytes layers by float Linears holding their dequantized weights (before PEFT wraps
    the model); returns how many were replaced."""
    replaced = 0
    for name, layer in list(module.named_modules()):
        if not is_quantized_linear(layer):
            continue
        replaced += 1
        dense = _dequantized_weight(layer)
        float_layer = nn.Linear(dense.shape[1], dense.shape[0], bias=layer.bias is not None)
        float_layer.weight = nn.Parameter(dense, requires_grad=False)
        if layer.bias is not None:
            float_layer.bias = nn.Parameter(layer.bias.detach().float().clone(), requires_grad=False)
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, float_layer)
    return replaced


def _dequantized_weight(layer: nn.Module) -> torch.Tensor:
    import bitsandbytes as bnb

    weight = layer.weight
    if type(weight).__name__ == "Params4bit":
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    # int8 rows with one absmax scale each: W = CB * SCB / 127
    return (weight.CB.float() * weight.SCB.float()[:, None] / 127.0).contiguous()
