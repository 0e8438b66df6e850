"""Load a model directory as its gpuforge.json describes it: transformers and PEFT directories through their
own loaders, other modules rebuilt by their builder (resized where channel pruning shrank them), and
compressed variants quantized like they were before their weights are filled in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model

from gpuforge.artifact.manifest import MANIFEST, Manifest, read_manifest
from gpuforge.errors import ModelError
from gpuforge.models import BuiltModel, ModelRequest, build_model, checked_options
from gpuforge.policy import current


def load_artifact(
    model_dir: str | Path, device: str | torch.device = "cpu", dequantize_base: bool = False
) -> tuple[torch.nn.Module, Any, Manifest]:
    """(module, tokenizer or None, manifest) of a saved model/ directory, in eval mode.

    dequantize_base: a QLoRA adapter's base is quantized as in training, then turned back into float
    layers holding those quantized values (what merging the adapter needs)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    tokenizer = load_saved_tokenizer(model_dir, manifest)
    if manifest.format == "onnx":  # gpuforge export: onnxruntime runs it
        from gpuforge.artifact.onnx_module import OnnxModule

        if manifest.onnx is None:
            raise ModelError(f"{model_dir}: {MANIFEST} says format onnx but has no onnx record")
        path = manifest.weights_path(model_dir)
        record = manifest.onnx
        module = OnnxModule(path, record.inputs, device, cache=record.cache,
                            max_positions=record.max_positions)  # fmt: skip
        return module.eval(), tokenizer, manifest
    if manifest.is_adapter:
        from peft import PeftModel

        base = build_model(_request(manifest, tokenizer))
        if manifest.quantize_base:  # the adapter was trained on the quantized base: rebuild that
            from gpuforge.weights.qlora import dequantize_linears, quantize_base

            base = quantize_base(base, manifest.quantize_base, manifest.modules_to_save or [], torch.float32)
            if dequantize_base:
                base.module.to(device)  # bitsandbytes quantizes when the layer is moved
                dequantize_linears(base.module)
        module = PeftModel.from_pretrained(base.module.to(device), str(model_dir))
    elif manifest.format == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForCausalLM if manifest.task == "causal-lm" else AutoModelForSequenceClassification
        # the options it was trained with, checked again under this process's policy (a manifest is a
        # file: it may have been edited), decide whether its own code may run
        options = checked_options(manifest.source, manifest.options, current().user_code)
        trust = options.get("trust_remote_code") is True
        if manifest.quantization:  # config only: the weights are quantized.pt
            config = AutoConfig.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=trust
            )
            module = auto.from_config(config, trust_remote_code=trust)
            _load_quantized(module, manifest, model_dir)
        else:
            module = auto.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=trust)
    else:
        module = build_model(_request(manifest, tokenizer)).module
        pruned = manifest.compression.prune if manifest.compression else None
        if pruned and pruned.resized:  # channel pruning made layers smaller than the builder makes them
            from gpuforge.weights.resize import apply_resized

            apply_resized(module, pruned.resized)
        if manifest.quantization:
            _load_quantized(module, manifest, model_dir)
        else:
            load_model(module, str(model_dir / "model.safetensors"))
    return module.to(device).eval(), tokenizer, manifest


def built_from(module: torch.nn.Module, manifest: Manifest) -> BuiltModel:
    """A loaded artifact's module as the task code takes it (tasks.forward needs to know its kind)."""
    is_transformers = hasattr(module, "config") and hasattr(module, "save_pretrained")
    return BuiltModel(module, is_transformers, manifest.source, adapter=hasattr(module, "peft_config"))


def load_saved_tokenizer(model_dir: Path, manifest: Manifest):
    """The tokenizer a model directory holds, or None (image models): without loading any weights."""
    if not manifest.tokenizer:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)


def _load_quantized(module: torch.nn.Module, manifest: Manifest, model_dir: Path) -> None:
    """A post-training-quantized variant (compress/): quantize the float skeleton the same way, then load."""
    from gpuforge.weights.quantize import load_quantized

    done = manifest.compression.quantize
    load_quantized(module, done.kind, manifest.weights_path(model_dir), skip=done.skip)


def _request(manifest: Manifest, tokenizer) -> ModelRequest:
    """How to rebuild the model (or the adapter's base) a manifest describes."""
    return ModelRequest(
        manifest.source,
        manifest.task,
        manifest.num_labels,
        manifest.labels,
        len(tokenizer) if tokenizer is not None else None,
        manifest.max_length,
        manifest.pretrained,
        manifest.options,
    )
