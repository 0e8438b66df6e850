"""Ways to adapt a model for cheaper training: LoRA through PEFT (any source), activation checkpointing.

LoRA: the base is frozen, low-rank factors train beside it.

Target modules are name patterns (fnmatch, matched against the full module name or its last parts), resolved
here to exact names so that a pattern matching nothing is an error that lists what could have matched.
"""

from __future__ import annotations

from torch import nn

from gpuforge.errors import SpecError
from gpuforge.models.base import BuiltModel, name_matches
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


def resolve_targets(module: nn.Module, patterns: list[str] | None, head: str | None = None) -> list[str]:
    """Exact module names for the patterns (or the defaults); an error names the candidates if none match."""
    candidates = adaptable_names(module)
    if head:  # the classification head trains fully (modules_to_save), it is not a LoRA target
        candidates = [n for n in candidates if not name_matches(n, head) and not n.startswith(head + ".")]
    wanted = patterns or list(DEFAULT_TARGETS)
    targets = [n for n in candidates if any(name_matches(n, p) for p in wanted)]
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
        if not any(name_matches(n, m) for n, _ in built.module.named_modules())
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
