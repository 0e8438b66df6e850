"""Weight-only int8/int4 for what torchao's configs leave in float: embeddings, convolutions, odd Linears.

In a small transformer the token embeddings hold about half the weights (MiniLM: 11.9 M of 22.7 M), and
in a small CNN the convolutions do: quantizing only the Linear layers leaves the model at 0.6-0.7 x its
float size. These modules store the weights quantized and dequantize on use:

- int8: symmetric, one scale per row (an embedding row, a conv output channel): w = q * s.
- int4: asymmetric in groups of 32 along the row (the whole row when its length is not a multiple of
  32), two values a byte, a float16 scale and minimum per group: w = q * s + m.

An embedding gathers the quantized rows first and dequantizes only those, so a lookup costs about what
it did in float. A convolution dequantizes its (small) weight each call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = weight.detach().float().flatten(1)
    scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    rows = weight.detach().float().flatten(1)
    length = rows.shape[1]
    group = GROUP if length % GROUP == 0 else length
    grouped = rows.reshape(rows.shape[0], length // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-8)
    q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(rows.shape[0], length)
    if length % 2:
        q = F.pad(q, (0, 1))
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scale.half(), low.half(), group


def _unpack_int4(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, length: int, group: int):
    """(..., length/2) bytes and (..., groups) scale/min -> (..., length) float32."""
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :length].float()
    q = q.reshape(*q.shape[:-1], length // group, group)
    return (q * scale.float()[..., None] + low.float()[..., None]).flatten(-2)


def _store_quantized(layer: nn.Module, weight: torch.Tensor, bits: int) -> None:
    """Register the quantized form of `weight` as buffers of `layer` (qweight, scale, and low for int4)."""
    if bits == 8:
        q, scale = _int8_rows(weight)
        layer.register_buffer("qweight", q)
        layer.register_buffer("scale", scale)
    else:
        packed, scale, low, layer.group = _int4_groups(weight)
        layer.register_buffer("qweight", packed)
        layer.register_buffer("scale", scale)
        layer.register_buffer("low", low)


class QuantizedEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, bits: int):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits, self.num_embeddings, self.embedding_dim = (
            bits,
            embedding.num_embeddings,
            embedding.embedding_dim,
        )
        self.padding_idx = embedding.padding_idx
        _store_quantized(self, embedding.weight, bits)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight)
        if self.bits == 8:
            return rows.float() * F.embedding(ids, self.scale[:, None])
        return _unpack_int4(
            rows, F.embedding(ids, self.scale), F.embedding(ids, self.low), self.embedding_dim, self.group
        )

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table, for code that reads `.weight` (e.g. a tied output head)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.qweight.device))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}"


class QuantizedConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d, bits: int):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits, self.shape = bits, tuple(conv.weight.shape)
        self.stride, self.padding, self.dilation, self.groups = (
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
        )
        self.bias = (
            nn.Parameter(conv.bias.detach().clone(), requires_grad=False) if conv.bias is not None else None
        )
        _store_quantized(self, conv.weight, bits)

    def dequantized(self) -> torch.Tensor:
        length = self.shape[1] * self.shape[2] * self.shape[3]
        if self.bits == 8:
            rows = self.qweight.float() * self.scale[:, None]
        else:
            rows = _unpack_int4(self.qweight, self.scale, self.low, length, self.group)
        return rows.reshape(self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized().to(x.dtype)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.shape[1]}, {self.shape[0]}, kernel_size={tuple(self.shape[2:])}, int{self.bits}"


class QuantizedLinear(nn.Module):
    """For a Linear whose shape torchao's kernel cannot take: dequantized on each call, like the conv."""

    def __init__(self, linear: nn.Linear, bits: int):
        super().__init__()
        self.bits, self.in_features, self.out_features = bits, linear.in_features, linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        _store_quantized(self, linear.weight, bits)

    def dequantized(self) -> torch.Tensor:
        if self.bits == 8:
            return self.qweight.float() * self.scale[:, None]
        return _unpack_int4(self.qweight, self.scale, self.low, self.in_features, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"


def replace_layer(module: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, layer)


def quantize_other_layers(
    module: nn.Module, bits: int, skip: list[str], keep: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Replace nn.Embedding and nn.Conv2d layers in place, except those under a name in `skip` and those
    in `keep` (name -> why they stay in float); (quantized, skipped with why)."""
    keep = keep or {}
    owners: dict[int, list[str]] = {}
    for name, layer in module.named_modules():
        weight = layer._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    done, skipped = [], {}
    for name, layer in list(module.named_modules()):
        if not isinstance(layer, (nn.Embedding, nn.Conv2d)):
            continue
        if not name:
            skipped["(the model itself)"] = "a model that is one layer cannot be swapped in place"
            continue
        if any(name == s or name.startswith(f"{s}.") for s in skip):
            skipped[name] = "skipped on request"
            continue
        if name in keep:
            skipped[name] = keep[name]
            continue
        if len(tied := [o for o in owners[id(layer.weight)] if o != name]) > 0:
            skipped[name] = f"weight tied to {tied[0]}"  # an LM head reads the same table as a matrix
            continue
        if isinstance(layer, nn.Embedding) and (layer.max_norm is not None or layer.sparse):
            skipped[name] = "an embedding with max_norm or sparse gradients stays in float"
            continue
        kind = QuantizedEmbedding if isinstance(layer, nn.Embedding) else QuantizedConv2d
        replace_layer(module, name, kind(layer, bits))
        done.append(name)
    return done, skipped
