"""Magnitude pruning: unstructured and 2:4 masks on weights, and channel pruning that shrinks layers.

Masks (unstructured, 2:4) zero weights in place and are returned, so a recovery fine-tune can keep the
zeros zero (recover.py); the saved artifact is then just a model with zeros in it. Channel pruning
removes whole hidden units of a producer -> consumer pair (a transformer's FFN, or Linear/Conv2d layers
in an nn.Sequential), so the layers really get smaller and a CPU runs them faster.

The output head (the last Linear-like layer) is never pruned: it is tiny and every logit depends on it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from gpuforge.errors import GpuforgeError
from gpuforge.spec import check_sparsity
from gpuforge.weights.resize import is_conv1d

# Layers that are pass-through per channel: a pruned channel stays a pruned channel through them.
_CHANNELWISE = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout, nn.Identity,
    nn.MaxPool2d, nn.AvgPool2d,
)  # fmt: skip
# Transformer FFNs: (up projection(s), down projection, config attribute holding the hidden width).
_FFN_FAMILIES = (
    (("*.intermediate.dense",), "*.output.dense", "intermediate_size"),  # BERT, RoBERTa, MiniLM
    (("*.mlp.c_fc",), "*.mlp.c_proj", "n_inner"),  # GPT-2
    (("*.mlp.gate_proj", "*.mlp.up_proj"), "*.mlp.down_proj", "intermediate_size"),  # LLaMA, Mistral
)


class PruneError(GpuforgeError):
    """A pruning request the model or the arguments cannot satisfy."""


@dataclass
class PruneResult:
    structure: str
    amount: float
    pruned: list[str] = field(default_factory=list)  # layer names
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> keep mask
    resized: dict[str, dict[str, int]] = field(default_factory=dict)  # layer -> new shape arguments
    config: dict[str, int] = field(default_factory=dict)  # transformers config fields changed


def check_amount(amount: float) -> None:
    """The bound the options check (spec/compress_bounds.py), again for callers of these functions alone."""
    try:
        check_sparsity(amount)
    except ValueError as err:
        raise PruneError(str(err)) from None


def _linear_like(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) or is_conv1d(m)
    ]


def weight_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Linear-like layers that may be pruned: all Linear, Conv1D and Conv2d but the last one (the head)."""
    return _linear_like(module)[:-1]


def magnitude_prune(module: nn.Module, amount: float, structure: str = "unstructured") -> PruneResult:
    """Zero the smallest-magnitude weights of every prunable layer, in place; returns the keep masks.

    unstructured: `amount` of each layer's weights (per layer, so no layer is emptied).
    2:4: two of every four consecutive input weights (amount is 0.5 by definition); layers whose input
    width is not a multiple of 4, and convolutions, are skipped and listed."""
    if structure not in ("unstructured", "2:4"):
        raise PruneError(f"prune structure must be unstructured or 2:4 here: got {structure!r}")
    check_amount(amount)
    result = PruneResult(structure, 0.5 if structure == "2:4" else amount)
    with torch.no_grad():
        for name, layer in weight_layers(module):
            weight = layer.weight
            if structure == "2:4":
                mask, why = _two_of_four_mask(layer)
                if mask is None:
                    result.skipped[name] = why
                    continue
            else:
                mask = _magnitude_mask(weight, amount)
            weight.mul_(mask)
            result.masks[f"{name}.weight" if name else "weight"] = mask
            result.pruned.append(name)
    if not result.pruned:
        raise PruneError(f"no layer could be pruned {structure}: {result.skipped or 'the model has none'}")
    return result


def _magnitude_mask(weight: torch.Tensor, amount: float) -> torch.Tensor:
    keep = weight.numel() - int(round(amount * weight.numel()))
    mask = torch.zeros(weight.numel(), dtype=torch.bool, device=weight.device)
    mask[weight.detach().abs().flatten().float().topk(keep).indices] = True
    return mask.view_as(weight)


def _two_of_four_mask(layer: nn.Module) -> tuple[torch.Tensor | None, str]:
    if isinstance(layer, nn.Conv2d):
        return None, "2:4 applies to linear layers (semi-structured kernels), not convolutions"
    weight = layer.weight.t() if is_conv1d(layer) else layer.weight  # -> (out, in)
    out_features, in_features = weight.shape
    if in_features % 4:
        return None, f"input width {in_features} is not a multiple of 4"
    groups = weight.detach().abs().float().reshape(out_features, in_features // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(2, dim=-1).indices, True)
    keep = keep.reshape(out_features, in_features)
    return (keep.t().contiguous() if is_conv1d(layer) else keep), ""


# --------------------------------------------------------------------------- channel pruning


@dataclass
class _Pair:
    """Hidden units shared by producers (their outputs) and one consumer (its inputs)."""

    producers: list[str]
    consumer: str
    norms: list[str] = field(default_factory=list)  # batch norms between them (per-channel parameters)
    spread: int = 1  # consumer inputs per channel (a Flatten between conv and linear)
    config_field: str | None = None


def prune_channels(module: nn.Module, amount: float, multiple_of: int = 8) -> PruneResult:
    """Remove `amount` of the hidden units of every producer -> consumer pair, in place.

    A unit's importance is the norm of its producer rows times the norm of its consumer columns (a unit
    that is written weakly or read weakly matters little). At least `amount` of each pair's units go
    (wide layers keep a multiple of `multiple_of`, see _units_kept); the FFNs of a transformer all have
    one width, and its config is updated to the new one."""
    check_amount(amount)
    pairs = _transformer_pairs(module) or _sequential_pairs(module)
    if not pairs:
        raise PruneError(
            "channel pruning found no producer -> consumer pair: it knows transformer FFNs (BERT, GPT-2, "
            "LLaMA families) and Linear/Conv2d chains inside nn.Sequential"
        )
    result = PruneResult("channel", amount)
    layers = dict(module.named_modules())
    for pair in pairs:
        width = _out_width(layers[pair.producers[0]])
        keep_n = _units_kept(width, amount, multiple_of)
        if keep_n >= width:
            result.skipped[pair.consumer] = f"{width} units: nothing to remove at {amount:.0%}"
            continue
        score = torch.ones(width)
        for name in pair.producers:
            score *= _unit_norms(layers[name], "out")
        score *= _unit_norms(layers[pair.consumer], "in", pair.spread)
        keep = score.topk(keep_n).indices.sort().values
        with torch.no_grad():
            for name in pair.producers:
                result.resized[name] = _shrink(module, name, "out", keep)
            for name in pair.norms:
                result.resized[name] = _shrink(module, name, "norm", keep)
            result.resized[pair.consumer] = _shrink(module, pair.consumer, "in", keep, pair.spread)
        result.pruned.append(pair.consumer)
        if pair.config_field:
            result.config[pair.config_field] = keep_n
    if result.config and hasattr(module, "config"):
        for key, value in result.config.items():
            setattr(module.config, key, value)
    return result


def _units_kept(width: int, amount: float, multiple_of: int) -> int:
    """At least `amount` of the units go; wide layers keep a multiple of `multiple_of` (matmul kernels
    like round widths), narrow ones (under 32 x that) are cut to the unit."""
    step = multiple_of if width >= 32 * multiple_of else 1
    return max(step, int(width * (1 - amount) + 1e-9) // step * step)


def _transformer_pairs(module: nn.Module) -> list[_Pair]:
    names = [name for name, _ in module.named_modules()]
    for ups, down, config_field in _FFN_FAMILIES:
        pairs = []
        for name in names:
            if not fnmatch.fnmatchcase(name, down):
                continue
            block = name[: -len(down[1:])]  # "bert.encoder.layer.0" of "bert.encoder.layer.0.output.dense"
            producers = [block + up[1:] for up in ups]
            if all(p in names for p in producers):
                pairs.append(_Pair(producers, name, config_field=config_field))
        if pairs:
            return pairs
    return []


def _sequential_pairs(module: nn.Module) -> list[_Pair]:
    pairs = []
    layers = _linear_like(module)
    head = layers[-1][0] if layers else None
    for seq_name, seq in module.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (name, producer) in enumerate(children):
            if not isinstance(producer, (nn.Linear, nn.Conv2d)) or getattr(producer, "groups", 1) != 1:
                continue
            pair = _Pair([_join(seq_name, name)], "")
            channels = _out_width(producer)
            for child_name, child in children[i + 1 :]:
                if isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d)) and child.num_features == channels:
                    pair.norms.append(_join(seq_name, child_name))
                elif isinstance(child, _CHANNELWISE):
                    continue
                elif isinstance(child, nn.Flatten):
                    pair.spread = 0  # set from the consumer's width below
                elif isinstance(child, (nn.Linear, nn.Conv2d)) and getattr(child, "groups", 1) == 1:
                    inputs = child.in_features if isinstance(child, nn.Linear) else child.in_channels
                    if pair.spread == 0 and isinstance(child, nn.Linear) and inputs % channels == 0:
                        pair.spread = inputs // channels
                    if inputs == channels * max(pair.spread, 1):
                        pair.consumer = _join(seq_name, child_name)
                    break
                else:
                    break
            # a consumer that is the head still counts: its inputs shrink, its outputs do not
            if pair.consumer and pair.spread >= 1 and (pair.producers[0] != head):
                pairs.append(pair)
    return pairs


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _out_width(layer: nn.Module) -> int:
    if isinstance(layer, nn.Conv2d):
        return layer.out_channels
    if is_conv1d(layer):
        return layer.nf
    return layer.out_features


def _unit_norms(layer: nn.Module, side: str, spread: int = 1) -> torch.Tensor:
    """Per hidden unit: the norm of the weights that write it (side "out") or read it (side "in")."""
    weight = layer.weight.detach().float()
    if is_conv1d(layer):
        weight = weight.t()  # -> (out, in)
    if side == "out":
        return weight.flatten(1).norm(dim=1)
    columns = weight.transpose(0, 1).flatten(1)  # (in, ...) for Linear and Conv2d
    return columns.reshape(-1, spread * columns.shape[1]).norm(dim=1)


def _shrink(module: nn.Module, name: str, side: str, keep: torch.Tensor, spread: int = 1) -> dict[str, int]:
    """Replace layer `name` by a smaller one holding only the kept units; returns its new size fields."""
    layer = module.get_submodule(name)
    if side == "norm":
        layer.weight = nn.Parameter(layer.weight[keep].clone())
        layer.bias = nn.Parameter(layer.bias[keep].clone())
        layer.running_mean = layer.running_mean[keep].clone()
        layer.running_var = layer.running_var[keep].clone()
        layer.num_features = len(keep)
        return {"num_features": len(keep)}
    conv1d = is_conv1d(layer)
    weight = layer.weight.t() if conv1d else layer.weight  # (out, in, ...)
    if side == "out":
        weight = weight[keep]
        bias = layer.bias[keep] if layer.bias is not None else None
    else:
        columns = (keep[:, None] * spread + torch.arange(spread)).flatten()
        weight = weight[:, columns]
        bias = layer.bias
    layer.weight = nn.Parameter((weight.t() if conv1d else weight).contiguous())
    if bias is not None:
        layer.bias = nn.Parameter(bias.clone())
    if isinstance(layer, nn.Conv2d):
        layer.out_channels, layer.in_channels = layer.weight.shape[:2]
        return {"out_channels": layer.out_channels, "in_channels": layer.in_channels}
    if conv1d:
        layer.nx, layer.nf = layer.weight.shape
        return {"nx": layer.nx, "nf": layer.nf}
    layer.out_features, layer.in_features = layer.weight.shape
    return {"out_features": layer.out_features, "in_features": layer.in_features}


def to_semi_structured(module: nn.Module, names: list[str]) -> dict[str, str]:
    """On CUDA, hand the 2:4-pruned Linear layers `names` to torch's semi-structured sparse kernels
    (half the weight bytes, faster matmuls on Ampere and later); returns name -> why it was left dense.
    Needs fp16/bf16 weights; on a CPU every layer stays dense (the kernels are CUDA-only)."""
    from torch.sparse import to_sparse_semi_structured

    left: dict[str, str] = {}
    for name in names:
        layer = module.get_submodule(name)
        weight = layer.weight
        if not isinstance(layer, nn.Linear):
            left[name] = "not an nn.Linear"
        elif weight.device.type != "cuda":
            left[name] = "semi-structured sparse kernels run on CUDA only"
        elif weight.dtype not in (torch.float16, torch.bfloat16):
            left[name] = f"weights are {weight.dtype}; the kernels take float16 or bfloat16"
        elif weight.shape[0] % 64 or weight.shape[1] % 64:
            left[name] = f"shape {tuple(weight.shape)} is not a multiple of 64 on both sides"
        else:
            try:
                layer.weight = nn.Parameter(to_sparse_semi_structured(weight.detach()), requires_grad=False)
            except (RuntimeError, ValueError) as err:  # no kernel for this GPU or build
                left[name] = f"torch refused: {err}"
    return left
