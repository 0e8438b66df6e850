"""The run's model/ directory: the trained model plus gpuforge.json saying how to load it.

transformers models are saved with save_pretrained (loadable by transformers alone); other modules as
model.safetensors beside the source and options that rebuild them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_file, save_model

from gpuforge.errors import ModelError
from gpuforge.models import BuiltModel, ModelRequest, build_model, checked_options
from gpuforge.policy import current
from gpuforge.spec import JobSpec

MANIFEST = "gpuforge.json"


def save_artifact(
    model_dir: Path,
    built: BuiltModel,
    tokenizer,
    spec: JobSpec,
    labels: list[str] | None,
    extra: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """`state_dict`: the weights to write when the module holds only a shard of them (FSDP's rank 0)."""
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if built.adapter:
        built.module.save_pretrained(str(tmp))  # PEFT: adapter_config.json + adapter_model.safetensors
        fmt = "peft-adapter"
    elif built.is_transformers:
        built.module.save_pretrained(str(tmp), state_dict=state_dict)
        fmt = "transformers"
    else:
        if state_dict is not None:
            save_file(state_dict, str(tmp / "model.safetensors"))
        else:
            save_model(built.module, str(tmp / "model.safetensors"))
        fmt = "state_dict"
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    manifest = {
        "format": fmt,
        "kind": "adapter" if built.adapter else "full",
        "base": spec.model.source if built.adapter else None,  # an adapter loads on top of this base
        "pretrained": built.extra.get("pretrained"),
        "lora_targets": built.extra.get("lora_targets"),
        "modules_to_save": built.extra.get("modules_to_save"),
        "quantize_base": built.extra.get("quantize_base"),
        "task": spec.model.task,
        "source": spec.model.source,
        "options": spec.model.options,
        "labels": labels,
        "num_labels": len(labels) if labels else None,
        "max_length": spec.data.max_length,
        "tokenizer": "saved" if tokenizer is not None else None,
        "job": spec.name,
        **extra,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)


def load_artifact(model_dir: str | Path, device: str | torch.device = "cpu", dequantize_base: bool = False):
    """(module, tokenizer or None, manifest) of a saved model/ directory, in eval mode.

    dequantize_base: a QLoRA adapter's base is quantized as in training, then turned back into float
    layers holding those quantized values (what merging the adapter needs)."""
    model_dir = Path(model_dir)
    manifest = json.loads((model_dir / MANIFEST).read_text())
    tokenizer = load_saved_tokenizer(model_dir, manifest)
    if manifest["kind"] == "adapter":
        from peft import PeftModel

        base = build_model(_request(manifest, tokenizer))
        if manifest.get("quantize_base"):  # the adapter was trained on the quantized base: rebuild that
            from gpuforge.weights.qlora import dequantize_linears, quantize_base

            base = quantize_base(
                base, manifest["quantize_base"], manifest.get("modules_to_save") or [], torch.float32
            )
            if dequantize_base:
                base.module.to(device)  # bitsandbytes quantizes when the layer is moved
                dequantize_linears(base.module)
        module = PeftModel.from_pretrained(base.module.to(device), str(model_dir))
    elif manifest["format"] == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForCausalLM if manifest["task"] == "causal-lm" else AutoModelForSequenceClassification
        # the options it was trained with, checked again under this process's policy (a manifest is a
        # file: it may have been edited), decide whether its own code may run
        options = checked_options(manifest["source"], manifest.get("options") or {}, current().user_code)
        trust = options.get("trust_remote_code") is True
        if _quantized(manifest):  # config only: the weights are quantized.pt
            config = AutoConfig.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=trust
            )
            module = auto.from_config(config, trust_remote_code=trust)
            _load_quantized(module, manifest, model_dir)
        else:
            module = auto.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=trust)
    else:
        module = build_model(_request(manifest, tokenizer)).module
        resized = manifest.get("compression", {}).get("prune", {}).get("resized")
        if resized:  # channel pruning made layers smaller than the builder makes them
            from gpuforge.weights.resize import apply_resized

            apply_resized(module, resized)
        if _quantized(manifest):
            _load_quantized(module, manifest, model_dir)
        else:
            load_model(module, str(model_dir / "model.safetensors"))
    return module.to(device).eval(), tokenizer, manifest


def built_from(module: torch.nn.Module, manifest: dict[str, Any]) -> BuiltModel:
    """A loaded artifact's module as the task code takes it (tasks.forward needs to know its kind)."""
    is_transformers = hasattr(module, "config") and hasattr(module, "save_pretrained")
    return BuiltModel(
        module, is_transformers, manifest.get("source", ""), adapter=hasattr(module, "peft_config")
    )


def load_saved_tokenizer(model_dir: Path, manifest: dict[str, Any]):
    """The tokenizer a model directory holds, or None (image models): without loading any weights."""
    if not manifest.get("tokenizer"):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)


def _quantized(manifest: dict[str, Any]) -> bool:
    return "quantize" in manifest.get("compression", {})


def _load_quantized(module: torch.nn.Module, manifest: dict[str, Any], model_dir: Path) -> None:
    """A post-training-quantized variant (compress/): quantize the float skeleton the same way, then load."""
    from gpuforge.weights.quantize import load_quantized

    done = manifest["compression"]["quantize"]
    weights = (model_dir / manifest["weights"]).resolve()
    if model_dir.resolve() not in weights.parents:  # a manifest is a file: it names its own files only
        raise ModelError(
            f"{model_dir}: gpuforge.json names weights outside the directory: {manifest['weights']}"
        )
    load_quantized(module, done["kind"], weights, skip=done["skip"])


def _request(manifest: dict[str, Any], tokenizer) -> ModelRequest:
    """How to rebuild the model (or the adapter's base) a manifest describes."""
    return ModelRequest(
        manifest["source"],
        manifest["task"],
        manifest["num_labels"],
        manifest["labels"],
        len(tokenizer) if tokenizer is not None else None,
        manifest["max_length"],
        manifest.get("pretrained"),
        manifest["options"],
    )
