"""Learning-rate schedule: linear warm-up, then cosine, warm-stable-decay (wsd) or constant.

    scheduler = make_scheduler(optimizer, Shape.of(spec, built, total_steps))

`train.schedule: auto` picks wsd when `stop_at` or `early_stop` may end the run before `max_steps`: the
user set max_steps as a ceiling, so a cosine stretched over it would hold the rate near its peak for the
steps that run and decay only in steps that never do (or, with a low ceiling, decay too soon). wsd holds
the peak and decays only in the last WSD_DECAY of the steps, so a run stopped early trained at full rate
and one that reaches the ceiling still ends on a low rate.

Warm-up by what trains, unless `warmup_steps` or `warmup_ratio` says: LoRA factors start at zero (B = 0)
and a model trained from scratch has no features a large first step would wreck, so neither needs one;
full fine-tuning of pretrained weights gets 5% of the steps, at most 100, since Adam's first updates, with
its second moments still near zero, can throw the weights off the minimum they start in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("cosine", "wsd", "constant")
WSD_DECAY = 0.2  # wsd: the share of the steps, at the end, over which the rate decays
FINE_TUNE_WARMUP_RATIO = 0.05
FINE_TUNE_WARMUP_MAX = 100


@dataclass(frozen=True)
class Shape:
    """What the schedule does, in steps: `kind` is cosine, wsd or constant (auto resolved)."""

    kind: str
    warmup: int
    total: int
    min_ratio: float
    why: str  # one line for the log: the kind and the warm-up, and why each

    @classmethod
    def of(cls, train, trained: str, total_steps: int) -> Shape:
        """The schedule of a job's `train` section; `trained`: "lora", "scratch" or "full" (what trains)."""
        kind, kind_why = train.schedule, "train.schedule"
        if kind == "auto":
            ends_early = bool(train.stop_at) or train.early_stop is not None
            kind = "wsd" if ends_early else "cosine"
            kind_why = "stop_at/early_stop may end it before max_steps" if ends_early else "auto"
        warmup, warmup_why = default_warmup(trained, total_steps)
        if train.warmup_steps is not None:
            warmup, warmup_why = min(train.warmup_steps, total_steps), "train.warmup_steps"
        elif train.warmup_ratio is not None:
            warmup, warmup_why = round(train.warmup_ratio * total_steps), "train.warmup_ratio"
        why = f"{kind} ({kind_why}), {warmup} warm-up steps ({warmup_why})"
        return cls(kind, warmup, total_steps, train.min_lr_ratio, why)

    @classmethod
    def kept(cls, stored: object, train, total_steps: int) -> Shape:
        """A resumed run's schedule: the kind and warm-up its checkpoint recorded (the spec's auto and its
        defaults may resolve otherwise today); a checkpoint from before schedules had kinds ran cosine
        with train.warmup_steps, or warmup_ratio (0.05 then by default) of the steps."""
        if isinstance(stored, dict) and stored.get("kind") in KINDS and isinstance(stored.get("warmup"), int):
            kind, warmup = stored["kind"], stored["warmup"]
            return cls(
                kind, warmup, total_steps, train.min_lr_ratio, f"{kind}, {warmup} warm-up steps (kept)"
            )
        if train.warmup_steps is not None:
            warmup = train.warmup_steps
        else:
            warmup = round((0.05 if train.warmup_ratio is None else train.warmup_ratio) * total_steps)
        why = f"cosine, {warmup} warm-up steps (a checkpoint from before train.schedule: as the run began)"
        return cls("cosine", warmup, total_steps, train.min_lr_ratio, why)

    def recorded(self) -> dict[str, object]:
        """What a checkpoint keeps of it (Shape.kept reads it back)."""
        return {"kind": self.kind, "warmup": self.warmup}

    def factor(self, step: int) -> float:
        """Multiplier of the base lr for the optimizer step `step` (0-based)."""
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            decay = max(1, round(WSD_DECAY * (self.total - self.warmup)))
            start = self.total - decay
            if step < start:
                return 1.0
            progress = min(1.0, (step - start + 1) / decay)
            return 1.0 - (1.0 - self.min_ratio) * progress  # linear to lr * min_ratio at the last step
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_warmup(trained: str, total_steps: int) -> tuple[int, str]:
    """Warm-up steps when the spec names none, and why (see the module's docstring)."""
    if trained == "lora":
        return 0, "LoRA: its factors start at zero"
    if trained == "scratch":
        return 0, "a model trained from scratch"
    steps = min(round(FINE_TUNE_WARMUP_RATIO * total_steps), FINE_TUNE_WARMUP_MAX)
    return steps, "full fine-tuning of pretrained weights: 5% of the steps, at most 100"


def make_scheduler(optimizer: torch.optim.Optimizer, shape: Shape):
    # a plain function, which LambdaLR leaves out of its state_dict: the shape comes from the spec
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: shape.factor(step))
