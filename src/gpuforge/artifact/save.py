"""Write a trained model as a model directory (weights, tokenizer, gpuforge.json), moved into place whole."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model

from gpuforge.artifact.manifest import Manifest, write_manifest
from gpuforge.models import BuiltModel
from gpuforge.spec import JobSpec


def save_artifact(
    model_dir: Path,
    built: BuiltModel,
    tokenizer,
    spec: JobSpec,
    labels: list[str] | None,
    extra: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """`extra`: more manifest fields (step, precision, sample_shape). `state_dict`: the weights to write
    when the module holds only a shard of them (FSDP's rank 0)."""
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
    manifest = Manifest(
        format=fmt,
        kind="adapter" if built.adapter else "full",
        base=spec.model.source if built.adapter else None,
        pretrained=built.extra.get("pretrained"),
        lora_targets=built.extra.get("lora_targets"),
        modules_to_save=built.extra.get("modules_to_save"),
        quantize_base=built.extra.get("quantize_base"),
        task=spec.model.task,
        source=spec.model.source,
        options=spec.model.options,
        labels=labels,
        num_labels=len(labels) if labels else None,
        max_length=spec.data.max_length,
        tokenizer="saved" if tokenizer is not None else None,
        job=spec.name,
        **extra,
    )
    write_manifest(tmp, manifest)
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
