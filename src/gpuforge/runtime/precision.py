"""Numeric precision: what `auto` picks, the autocast context, and the fp16 gradient scaler.

    amp = MixedPrecision(choose_precision("auto", device), device)
    with amp.autocast():
        loss = loss_of(model(batch))
    amp.backward(loss)                                       # scaled first under fp16
    refused = amp.step(optimizer, params, max_norm=1.0)      # unscale, clip, step: None when it stepped

Training, the pruning recovery and `gpuforge plan`'s measured steps all go through MixedPrecision;
evaluation and serving need only `autocast`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gpuforge.errors import GpuforgeError
from gpuforge.hardware.bench import peak_flops

# bf16 must beat fp32 by this much on a CPU's matmul to be worth its coarser rounding.
CPU_BF16_MIN_GAIN = 1.15


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32
    reason: str  # why this one, for the log and the summary

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"  # fp16 gradients underflow without loss scaling; bf16 has fp32's range


def choose_precision(requested: str, device: torch.device) -> Precision:
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise GpuforgeError(
                "train.precision: bf16 was asked for but this GPU does not support it; use fp16"
            )
        return Precision(requested, "asked for in the spec")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", "auto: the GPU supports bf16 (tensor cores, no loss scaling needed)")
        return Precision("fp16", "auto: the GPU lacks bf16; fp16 with a gradient scaler")
    if device.type == "mps":
        return Precision("fp16", "auto: fp16 autocast is the fast path on Apple GPUs")
    fp32, bf16 = peak_flops(device, "fp32"), peak_flops(device, "bf16")
    if bf16 >= CPU_BF16_MIN_GAIN * fp32:
        return Precision("bf16", f"auto: bf16 matmul measured {bf16 / fp32:.1f}x fp32 on this CPU")
    return Precision("fp32", f"auto: bf16 matmul measured only {bf16 / fp32:.2f}x fp32 on this CPU")


def autocast(precision: Precision, device: torch.device):
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)


class MixedPrecision:
    """A precision at work on a device: the forward's autocast, and the gradient scaler fp16 needs.

    fp16 gradients underflow without loss scaling: the loss is scaled up before backward and the gradients
    scaled back down before anything reads them; the scaler skips a step whose gradients hold inf/NaN and
    lowers its scale. bf16 and fp32 have no scaler, so there a non-finite gradient norm refuses the step:
    a finite loss can still give NaN/inf gradients, and one optimizer step on them would poison the weights
    and every checkpoint after.

    `loss_scaling` overrides the precision's own need of a scaler (False: fp16 without one)."""

    def __init__(self, precision: Precision, device: torch.device, loss_scaling: bool | None = None):
        self.precision, self.device = precision, device
        scaled = precision.needs_scaler if loss_scaling is None else loss_scaling
        self.scaler = torch.amp.GradScaler(device.type) if scaled else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward runs in (the loss is computed in fp32 outside it)."""
        return autocast(self.precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients at their true size (a no-op without a scaler); at most once per step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(
        self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float | None = None
    ) -> str | None:
        """Unscale, clip the gradient norm of `params` to `max_norm` (None or 0: measure it only), then step.

        Returns None when the optimizer stepped (or the scaler skipped a non-finite step), else why the step
        was refused: a non-finite gradient norm without a scaler."""
        self.unscale(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor, the same on every rank
            norm = norm.full_tensor()
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
            return None
        if not math.isfinite(float(norm)):
            return f"gradient norm is {float(norm)}"
        optimizer.step()
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state, for a checkpoint; None without a scaler."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)
