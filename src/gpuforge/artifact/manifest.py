"""gpuforge.json, the manifest of a model directory: what the model is and how to load it (contract).

Written by training (save.py) and by compression (compress/pipeline.py: with a `compression` record),
read by load.py, compress/ and serve/. The file keeps the keys it has always had; `schema_version` (absent: 1)
says which layout it follows. A file is read as it is: keys this version does not know (a newer writer's) are
kept and written back, and keys an older writer left out stay out. A manifest is a file that may have been
edited, so what it says is checked where it matters: the weights it names (weights_path) and the builder
options (load.py, under the current policy).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuforge.errors import GpuforgeError, ModelError
from gpuforge.spec import Task, format_validation_error

MANIFEST = "gpuforge.json"
SCHEMA_VERSION = 1
log = logging.getLogger("gpuforge.artifact")


class ArtifactError(GpuforgeError):
    """A model directory that is not one, or whose run cannot be rebuilt."""


class Record(BaseModel):
    # extra keys allowed: a newer gpuforge's fields survive this one reading and rewriting the file
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class PruneRecord(Record):
    structure: str | None = None
    amount: float | None = None
    layers: int | None = None
    skipped: dict[str, str] = Field(default_factory=dict)  # layer -> why it was left alone
    resized: dict[str, dict[str, int]] = Field(default_factory=dict)  # layer -> its new shape arguments
    config: dict[str, int] = Field(default_factory=dict)  # transformers config fields changed


class RecoverRecord(Record):
    steps: int | None = None
    lr: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None


class QuantizeRecord(Record):
    kind: str
    layers: int | None = None
    skip: list[str] = Field(default_factory=list)  # layers kept in float


class Compression(Record):
    """What `gpuforge compress` did to the model it read (`from`), in the order it did it."""

    from_: str | None = Field(None, alias="from")
    # as given, not re-validated: a bound tightened later must not make a compressed model unreadable
    options: dict[str, Any] = Field(default_factory=dict)
    name: str | None = None
    merged: bool | None = None
    prune: PruneRecord | None = None
    recover: RecoverRecord | None = None
    quantize: QuantizeRecord | None = None
    quantize_skipped: dict[str, str] | None = None
    touched_ratio: float | None = None  # bytes of the quantized layers after / before
    params: int | None = None
    nonzero_params: int | None = None


class OnnxCacheRecord(Record):
    """A causal LM's graph that takes and gives its key/value cache: past_key_I, past_value_I in,
    present_key_I, present_value_I out, each [batch, heads, length, head_dim], so that generation reads
    each token once."""

    layers: int
    heads: int
    head_dim: int
    eos_token_ids: list[int] = Field(default_factory=list)  # where the model's generation ends
    vocab_size: int | None = None  # token ids a prompt may hold: [0, vocab_size)


class OnnxRecord(Record):
    """An ONNX export (gpuforge export): the graph file, how it was made, from which model directory."""

    file: str
    opset: int
    exporter: str  # torch's "dynamo" exporter, or "torchscript" where dynamo could not export the model
    inputs: list[str]  # the graph's input names, in order: input_ids, attention_mask, or pixel_values
    quantize: str | None = None  # "int8": onnxruntime's dynamic quantization of the weights
    from_: str | None = Field(None, alias="from")
    files: list[str] = Field(default_factory=list)  # what the export wrote: a re-export replaces just these
    max_positions: int | None = None  # the longest sequence the model takes (a transformers model's)
    cache: OnnxCacheRecord | None = None  # a causal LM exported with its key/value cache (it can generate)
    no_cache: str | None = None  # a causal LM exported as its logits alone: why its cache could not go in


class Manifest(Record):
    """The fields in the order the file has them; nothing but what identifies the model is required."""

    schema_version: int = SCHEMA_VERSION
    format: Literal["transformers", "peft-adapter", "state_dict", "onnx"]
    kind: Literal["full", "adapter"]
    base: str | None = None  # an adapter loads on top of this model source
    pretrained: bool | None = None
    lora_targets: list[str] | None = None
    modules_to_save: list[str] | None = None
    quantize_base: Literal["nf4", "int8"] | None = None  # a QLoRA adapter's base, quantized as in training
    task: Task
    source: str
    options: dict[str, Any] = Field(default_factory=dict)  # the builder's, re-checked when loaded
    labels: list[str] | None = None
    num_labels: int | None = None
    max_length: int | None = None
    tokenizer: Literal["saved"] | None = None
    job: str | None = None
    step: int | None = None
    precision: str | None = None
    sample_shape: list[int] | None = None  # one image input's shape
    compression: Compression | None = None
    weights: str | None = None  # the weights file a compressed variant wrote, inside its directory
    onnx: OnnxRecord | None = None  # format onnx: run by onnxruntime (artifact/onnx_module.py)

    @property
    def is_adapter(self) -> bool:
        return self.kind == "adapter"

    @property
    def quantization(self) -> str | None:
        """The quantization a compressed variant carries (int8, int4, ...), or None."""
        done = self.compression.quantize if self.compression else None
        return done.kind if done else None

    def weights_path(self, model_dir: Path) -> Path:
        """The weights file it names, refused unless inside `model_dir`."""
        if not self.weights:
            raise ModelError(f"{model_dir}: {MANIFEST} names no weights file")
        path = (model_dir / self.weights).resolve()
        if model_dir.resolve() not in path.parents:
            raise ModelError(f"{model_dir}: {MANIFEST} names weights outside the directory: {self.weights}")
        return path

    def to_dict(self) -> dict[str, Any]:
        """The file's content: the keys that were read or set (an old file's missing ones stay missing),
        under their JSON names. As in summary.json (runs.py), a file without schema_version is version 1:
        it is written from version 2 on, first, so that version 1's files stay as they have always been."""
        content = self.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"schema_version"})
        return content if self.schema_version == 1 else {"schema_version": self.schema_version, **content}

    def __getitem__(self, key: str) -> Any:
        """The value under a key of the file, as JSON (nested records as dicts), for code that checks the
        file's contract by its names; KeyError where the file has no such key."""
        return self.to_dict()[key]


def read_manifest(model_dir: str | Path) -> Manifest:
    """The manifest of `model_dir`; an ArtifactError that names the file and the field when it is not one."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{model_dir}: not a gpuforge model directory (no {MANIFEST})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path}: not readable as JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as err:
        raise ArtifactError(f"{path}: {format_validation_error(err)}") from None
    if manifest.schema_version > SCHEMA_VERSION:
        log.warning(
            "%s: schema_version %d, newer than this gpuforge's %d; the keys it does not know are ignored",
            path, manifest.schema_version, SCHEMA_VERSION,
        )  # fmt: skip
    return manifest


def write_manifest(model_dir: Path, manifest: Manifest) -> None:
    (model_dir / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
