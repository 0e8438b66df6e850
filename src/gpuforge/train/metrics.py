"""Throughput, MFU, ETA and cost: the figures metrics.jsonl and summary.json report."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from gpuforge.models.base import BuiltModel
from gpuforge.runtime import tasks
from gpuforge.runtime.precision import Precision, autocast


class FlopModel:
    """FLOPs of one training step (forward + backward), from its samples and tokens.

    Transformers: 6 x non-embedding parameters x tokens (the usual estimate). Other models (CNNs): a
    measured count of one forward + backward on a real sample, by torch.utils.flop_counter.
    """

    def __init__(
        self, built: BuiltModel, task: str, sample_batch: dict[str, torch.Tensor], precision: Precision
    ):
        self.per_token = self.per_sample = 0.0
        if task == "image-classification" or not built.is_transformers:
            self.per_sample = self._measure_per_sample(built, task, sample_batch, precision)
            self.method = "measured (torch.utils.flop_counter)"
        else:
            # forward 2N, activation gradients 2N, weight gradients 2N only where weights train
            factor = 4.0 if built.adapter else 6.0
            self.per_token = factor * (built.num_parameters - built.num_embedding_parameters)
            self.method = f"{factor:.0f} x non-embedding params x tokens"

    @staticmethod
    def _measure_per_sample(built: BuiltModel, task: str, batch: dict[str, torch.Tensor], precision) -> float:
        module = built.module
        was_training = module.training
        module.eval()  # no dropout RNG draws, no batch-norm statistics updated by this probe
        device = next(module.parameters()).device
        with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
            with autocast(precision, device):  # as in training: a LoRA base may be held in bf16
                logits = tasks.forward(built, task, batch)
            loss, _ = tasks.loss_sum_and_count(task, logits, batch)
            loss.backward()
        module.zero_grad(set_to_none=True)
        module.train(was_training)
        samples, _ = tasks.count(task, batch)
        return counter.get_total_flops() / max(1, samples)

    def step_flops(self, samples: int, tokens: int) -> float:
        return self.per_token * tokens + self.per_sample * samples


@dataclass(frozen=True)
class Meter:
    """Model FLOPs utilisation: the FLOPs a run's steps do, against what its devices can do."""

    flops: FlopModel
    device_peak: float  # one device's measured matmul FLOP/s at the run's precision
    devices: int

    def mfu(self, samples: int, tokens: int, seconds: float) -> float:
        return self.flops.step_flops(samples, tokens) / seconds / (self.device_peak * self.devices)


class StepClock:
    """Recent step times, for a robust ETA and the median step time."""

    def __init__(self, window: int = 50):
        self.recent: deque[float] = deque(maxlen=window)
        self.all: list[float] = []

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.all.append(seconds)

    def eta(self, remaining_steps: int) -> float:
        return statistics.median(self.recent) * remaining_steps if self.recent else float("nan")

    def median(self) -> float:
        return statistics.median(self.all) if self.all else float("nan")


def usd(seconds: float, usd_per_hour: float) -> float:
    return seconds * usd_per_hour / 3600.0
