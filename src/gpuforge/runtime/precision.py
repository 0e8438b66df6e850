"""Numeric precision: what `auto` picks, the autocast context, and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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


def make_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device.type) if precision.needs_scaler else None
