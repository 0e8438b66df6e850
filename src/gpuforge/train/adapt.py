"""Ways to adapt a model for cheaper training: LoRA through PEFT (any source), activation checkpointing.

LoRA: the base is frozen, low-rank factors train beside it.

Target modules are name patterns (fnmatch, matched against the full module name or its last parts), resolved
here to exact names so that a pattern matching nothing is an error that lists what could have matched.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from gpuforge.errors import SpecError
from gpuforge.models.base import BuiltModel
from gpuforge.spec import LoraSpec

# Layers LoRA can wrap (PEFT supports these for plain torch modules too).
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
# Where no target is given, the attention projections of well-known transformers families.
DEFAULT_TARGETS = ("query", "value", "q_proj", "v_proj", "c_attn", "qkv_proj", "Wqkv")
PEFT_TASKS = {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}


def adaptable_names(module: nn.Module) -> list[str]:
    names = [name for name, m in module.named_modules() if isinstance(m, ADAPTABLE)]
    try:  # transformers' GPT-2 uses its own Conv1D (a linear layer with transposed weight)
        from transformers.pytorch_utils import Conv1D

        names += [name for name, m in module.named_modules() if isinstance(m, Conv1D)]
    except ImportError:
        pass
    return sorted(set(names))


def _matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def resolve_targets(module: nn.Module, patterns: list[str] | None, head: str | None = None) -> list[str]:
    """Exact module names for the patterns (or the defaults); an error names the candidates if none match."""
    candidates = adaptable_names(module)
    if head:  # the classification head trains fully (modules_to_save), it is not a LoRA target
        candidates = [n for n in candidates if not _matches(n, head) and not n.startswith(head + ".")]
    wanted = patterns or list(DEFAULT_TARGETS)
    targets = [n for n in candidates if any(_matches(n, p) for p in wanted)]
    if not targets:
        shown = ", ".join(candidates[:12]) + (
            f", ... ({len(candidates)} in all)" if len(candidates) > 12 else ""
        )
        what = f"the patterns {patterns}" if patterns else "the default targets (attention query/value)"
        raise SpecError(f"adapt.lora.target_modules: {what} match no adaptable module; modules seen: {shown}")
    return targets


def classifier_head(built: BuiltModel, task: str) -> str | None:
    """The name of a transformers model's classification head, which must train in full under LoRA."""
    if task != "sequence-classification" or not built.is_transformers:
        return None
    for name in ("classifier", "score"):
        if hasattr(built.module, name):
            return name
    return None


def apply_lora(built: BuiltModel, lora: LoraSpec, task: str) -> BuiltModel:
    """Wrap the model with LoRA factors; only they (and any modules_to_save) stay trainable."""
    from peft import LoraConfig, get_peft_model

    head = classifier_head(built, task)
    targets = resolve_targets(built.module, lora.target_modules, head)
    # once each, in order: the spec may name the head too
    to_save = list(dict.fromkeys([*(lora.modules_to_save or []), *([head] if head else [])]))
    missing = [
        m
        for m in lora.modules_to_save or []
        if not any(_matches(n, m) for n, _ in built.module.named_modules())
    ]
    if missing:
        raise SpecError(f"adapt.lora.modules_to_save: {', '.join(missing)} match no module of the model")
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        modules_to_save=list(to_save) or None,  # a copy: PEFT appends its own head names to this list
        task_type=PEFT_TASKS.get(task) if built.is_transformers else None,
        fan_in_fan_out=_is_gpt2_conv1d(built.module, targets),
    )
    module = get_peft_model(built.module, config)
    return BuiltModel(
        module,
        built.is_transformers,
        f"{built.description} + LoRA r={lora.r} on {len(targets)} modules",
        {**built.extra, "lora_targets": targets, "modules_to_save": to_save},
        adapter=True,
    )


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
            _matches(name, s) or name.startswith(s + ".") for s in skip
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


def enable_activation_checkpointing(built: BuiltModel) -> None:
    """Recompute activations in the backward pass instead of keeping them (transformers models)."""
    module = built.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    if not hasattr(base, "gradient_checkpointing_enable"):
        raise SpecError(
            "train.gradient_checkpointing: only transformers models (bundled:, hf:) support it; "
            f"{type(base).__name__} does not"
        )
    # non-reentrant: works with a frozen base (LoRA) without forcing gradients on the inputs
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 names it so
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _is_gpt2_conv1d(module: nn.Module, targets: list[str]) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return False
    modules = dict(module.named_modules())
    return any(isinstance(modules[t], Conv1D) for t in targets)


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
