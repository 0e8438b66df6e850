"""LoRA merge: fold an adapter into its base, so the run's model stands alone (no PEFT at load time).

W' = W + (alpha / r) * B @ A for every adapted layer (PEFT's merge_and_unload); modules trained in full
beside LoRA (a classification head) replace the base's. For an adapter trained on a quantized base
(QLoRA), the base is loaded with each quantized layer turned back into a float Linear holding the
dequantized weights the adapter was trained against (weights/qlora.dequantize_linears), so the merged
model computes what base + adapter computed.
"""

from __future__ import annotations

from torch import nn

from gpuforge.errors import GpuforgeError
from gpuforge.weights.qlora import is_quantized_linear


class MergeError(GpuforgeError):
    """The model has no adapter to merge."""


def merge_adapter(module: nn.Module) -> nn.Module:
    """The base model with the adapter folded in (a new module object; PEFT's wrappers are gone).

    A QLoRA adapter must be loaded on a dequantized base first: load_artifact(..., dequantize_base=True)."""
    if not hasattr(module, "merge_and_unload"):
        raise MergeError("--merge: this model has no LoRA adapter (the run trained the full model)")
    if any(is_quantized_linear(layer) for layer in module.modules()):
        raise MergeError("--merge: load a QLoRA adapter with dequantize_base=True before merging")
    merged = module.merge_and_unload()
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged
