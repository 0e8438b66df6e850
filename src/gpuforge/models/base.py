"""What every model source takes and returns."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class ModelRequest:
    source: str
    task: str
    num_labels: int | None = None
    labels: list[str] | None = None
    vocab_size: int | None = None
    max_length: int | None = None
    pretrained: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuiltModel:
    module: nn.Module
    is_transformers: bool  # a transformers PreTrainedModel: saved with save_pretrained, called by keyword
    description: str  # one line for logs: what was built and from where
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in model/gpuforge.json
    adapter: bool = False  # a PEFT model: the base is frozen, only adapter weights train and are saved

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    @property
    def num_embedding_parameters(self) -> int:
        return sum(
            p.numel() for m in self.module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        )


def name_matches(name: str, pattern: str) -> bool:
    """Whether a module name matches a pattern (fnmatch), against the full name or any of its last parts."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))
