"""A transformers causal LM's key/value cache, whatever form its release gives it: the serving engine
(serve/generate.py) and the ONNX export (export/onnx.py) read and write it through these.

    out = model(input_ids=ids, use_cache=True, **{cache_argument(model): cache})
    layers = cache_layers(returned_cache(out))      # per layer (keys, values), [batch, heads, length, dim]
    cache = with_layers(returned_cache(out), edited)
"""

from __future__ import annotations

from typing import Any

import torch

from gpuforge.runtime.tasks import accepts


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model takes its cache by: `cache` in newer transformers, `past_key_values` before
    (where the old name still works it warns)."""
    return "cache" if accepts(model, "cache") else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The cache a forward returned, under either name."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each [batch, heads, length, head_dim]: a DynamicCache or legacy tuples."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k, v) for k, v in cache]


def with_layers(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`cache` holding `kv` instead (in place for a cache object, a new tuple for the legacy form)."""
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
        return cache
    if hasattr(cache, "key_cache"):
        cache.key_cache[:] = [k for k, _ in kv]
        cache.value_cache[:] = [v for _, v in kv]
        return cache
    return tuple(kv)
