"""`train.lr: auto`: a learning-rate range test at the start of a run picks the rate.

From the run's initial state, STEPS optimizer steps on the run's first training batches raise the rate
exponentially from MIN_LR to MAX_LR (AdamW, the run's clipping and precision), recording each step's loss
before its update; the test stops early once the loss runs away (DIVERGE times its smoothed best, or not
finite). Then every trained weight, buffer, the RNG and the loss scaler go back to what they were, and the
run starts from step 1 as if the test had not run, with the rate it picked.

The rule (`RULE`): smooth the losses (an exponential moving average, bias-corrected), find the rate at
the lowest smoothed loss, and take a tenth of it: the steepest part of the curve lies about a decade below
its minimum, and a rate there still lowers the loss quickly while one at the minimum is already on the
edge of blowing up. The curve, the rule and the pick are written to <run>/lr_find.json (the job page
draws it) and the log; the test's seconds are in the `lr_found` event and, as all of the process's
time, in the run's wall time and cost.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpuforge.run_files import read_lr_find
from gpuforge.runs import RunDir, write_json_atomic
from gpuforge.train.checkpoint import rng_state, set_rng_state
from gpuforge.train.step import forward_backward, make_optimizer

if TYPE_CHECKING:
    from gpuforge.train.signals import StopFlag
    from gpuforge.train.trainer import Trainer

log = logging.getLogger("gpuforge.train")

STEPS = 24
MIN_LR, MAX_LR = 1e-6, 1.0
DIVERGE = 4.0
SMOOTHING = 0.6  # weight of the past in the moving average: a few steps' noise, not the curve's shape
PLACEHOLDER_LR = 1e-3  # what the optimizer is built with before the test (or a checkpoint) sets the rate
RULE = "a tenth of the rate at the lowest smoothed loss"


@dataclass
class RangeTest:
    """The test's record, as lr_find.json holds it."""

    lr: float  # the pick
    rule: str
    reason: str  # one line: the pick and where it came from
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    steps: int  # run (fewer than planned when the loss ran away or a signal came)
    planned_steps: int
    seconds: float
    min_lr: float = MIN_LR
    max_lr: float = MAX_LR

    def write(self, run: RunDir) -> None:
        write_json_atomic(run.lr_find_path, asdict(self))


def rate_at(index: int, steps: int = STEPS) -> float:
    """The rate of the test's step `index` (0-based): MIN_LR to MAX_LR, evenly spaced on a log scale."""
    return MIN_LR * (MAX_LR / MIN_LR) ** (index / max(1, steps - 1))


def smooth(losses: list[float]) -> list[float]:
    out, average = [], 0.0
    for i, loss in enumerate(losses):
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        out.append(average / (1 - SMOOTHING ** (i + 1)))
    return out


def pick(lrs: list[float], losses: list[float]) -> tuple[float, str]:
    """The rule applied to a curve: (rate, why). Fewer than 3 usable points: MIN_LR-safe fallback."""
    finite = [(lr, loss) for lr, loss in zip(lrs, losses, strict=True) if math.isfinite(loss)]
    if len(finite) < 3:
        chosen = PLACEHOLDER_LR
        return chosen, f"lr {chosen:.3g}: the test got only {len(finite)} finite losses (the default rate)"
    smoothed = smooth([loss for _, loss in finite])
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    at_best = finite[best][0]
    if best == 0:  # the loss rose from the first step: the lowest rate tried is the best guess
        return at_best, f"lr {at_best:.3g}: the loss rose from the lowest rate tried ({MIN_LR:g})"
    chosen = at_best / 10
    return chosen, f"lr {chosen:.3g}: {RULE} ({at_best:.3g}, smoothed loss {smoothed[best]:.4g})"


def find_lr(t: Trainer, stop: StopFlag) -> RangeTest:
    """Run the range test on the trainer's model and data and put everything back; the record."""
    began = time.perf_counter()
    job, module = t.job, t.parallel.model
    saved = _snapshot(module)
    rng, scaler = rng_state(), (t.amp.scaler.state_dict() if t.amp.scaler is not None else None)
    optimizer = make_optimizer(module, MIN_LR, t.spec.train.weight_decay, job.device)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    lrs, losses = [], []
    module.train()
    try:
        for i in range(STEPS):
            lr = rate_at(i)
            for group in optimizer.param_groups:
                group["lr"] = lr
            indices = t.ranks.share(job.order.batch(i))
            loss, *_ = forward_backward(
                job.built, job.task, job.data.train, indices, job.micro, t.amp, t.parallel,
                job.order.global_batch,
            )  # fmt: skip
            if t.ranks.world > 1:
                loss = t.ranks.sum([loss], job.device)[0]
            lrs.append(lr)
            losses.append(loss)
            if not math.isfinite(loss) or _ran_away(losses):
                break
            t.amp.step(
                optimizer, trained, t.spec.train.grad_clip
            )  # refused (inf norm): the next step shows it
            optimizer.zero_grad(set_to_none=True)
            if stop.signal_name is not None:
                break
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        _restore(module, saved)
        set_rng_state(rng)
        if scaler is not None:
            t.amp.scaler.load_state_dict(scaler)
    chosen, reason = pick(lrs, losses)
    finite = [loss for loss in losses if math.isfinite(loss)]
    return RangeTest(
        lr=chosen,
        rule=RULE,
        reason=reason,
        lrs=lrs,
        losses=[loss if math.isfinite(loss) else None for loss in losses],
        smoothed=smooth(finite),
        steps=len(losses),
        planned_steps=STEPS,
        seconds=round(time.perf_counter() - began, 3),
    )


def _ran_away(losses: list[float]) -> bool:
    smoothed = smooth(losses)
    return len(smoothed) > 3 and smoothed[-1] > DIVERGE * min(smoothed)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of what the test changes: the trained weights and the buffers (batch norm's statistics)."""
    kept = {n: p for n, p in module.named_parameters() if p.requires_grad}
    kept.update(dict(module.named_buffers()))
    return {name: tensor.detach().clone() for name, tensor in kept.items()}


def _restore(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for name, value in saved.items():
            tensors[name].copy_(value)


def found_lr(root: Path) -> float | None:
    """The rate a run's range test picked; None where it has no (valid) lr_find.json."""
    record = read_lr_find(root)
    return record["lr"] if record else None


def range_test_steps(train) -> int:
    """Steps the range test adds before a fresh run's first (at most: it stops early when the loss runs
    away): what `gpuforge plan` counts in the run's time and cost."""
    return STEPS if train.lr == "auto" else 0


def initial_lr(lr: float | str) -> float:
    """train.lr as the optimizer is first built with: the number, or for auto a placeholder that the
    range test (or the checkpoint's optimizer state) replaces."""
    return PLACEHOLDER_LR if lr == "auto" else float(lr)
