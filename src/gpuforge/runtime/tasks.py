"""Per-task forward, loss and evaluation figures, the same for transformers and plain torch modules."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from gpuforge.models.base import BuiltModel


def forward(
    built: BuiltModel, task: str, batch: dict[str, torch.Tensor], module: torch.nn.Module | None = None
) -> torch.Tensor:
    """Logits for a batch. Transformers models take keywords; plain modules take the main input first.

    `module` calls a wrapper of the model instead (DDP), whose forward takes anything: what the model
    accepts is read from the model itself."""
    module = module or built.module
    if task == "image-classification":
        out = module(batch["pixel_values"])
    elif built.is_transformers:
        out = module(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")})
    elif "attention_mask" in batch and accepts(built.module, "attention_mask"):
        out = module(batch["input_ids"], attention_mask=batch["attention_mask"])
    else:
        out = module(batch["input_ids"])
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple | list) else out


def accepts(module: torch.nn.Module, name: str) -> bool:
    if hasattr(module, "get_base_model"):  # a PEFT wrapper forwards *args/**kwargs to its base
        module = module.get_base_model()
    return name in inspect.signature(module.forward).parameters


def loss_sum_and_count(
    task: str, logits: torch.Tensor, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy (in fp32) and the number of terms: samples, or predicted tokens for causal-lm."""
    if task == "causal-lm":
        ids = batch["input_ids"]
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(shifted, ids[:, 1:].reshape(-1), reduction="sum"), ids[:, 1:].numel()
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum"), len(batch["labels"])


def count(task: str, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(samples, tokens) in a batch; tokens are real (unpadded) tokens, 0 for images."""
    if task == "image-classification":
        return len(batch["labels"]), 0
    if "attention_mask" in batch:
        return len(batch["input_ids"]), int(batch["attention_mask"].sum())
    return len(batch["input_ids"]), batch["input_ids"].numel()


class EvalTally:
    """Accumulates loss and correct predictions over an evaluation pass."""

    def __init__(self, task: str):
        self.task, self.loss, self.terms, self.correct, self.samples = task, 0.0, 0, 0, 0

    def add(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        loss, terms = loss_sum_and_count(self.task, logits, batch)
        self.loss += float(loss)
        self.terms += terms
        if self.task != "causal-lm":
            self.correct += int((logits.argmax(-1) == batch["labels"]).sum())
            self.samples += len(batch["labels"])

    def result(self) -> dict[str, float]:
        mean = self.loss / max(1, self.terms)
        if self.task == "causal-lm":
            return {"loss": mean, "perplexity": math.exp(min(mean, 700.0))}
        return {"loss": mean, "accuracy": self.correct / max(1, self.samples)}
