"""`train.lr: auto`: a learning-rate range test at the start of a run picks the rate.

From the run's initial state, up to STEPS optimizer steps on the run's first training batch raise the
rate exponentially from MIN_LR to MAX_LR (AdamW, the run's clipping and precision), recording each step's
loss before its update. Then every trained weight, buffer, the RNG and the loss scaler go back to what
they were, and the run starts from step 1 as if the test had not run, with the rate it picked.

One batch, every step: with a new batch each step, the loss of a LoRA classifier moved more with which
examples a batch held than with the rate (measured: flat to within that noise up to 5e-2, so the picks
of three seeds spread 20x, two of them past the rate's cliff). On one batch the curve is the rate's
alone: flat, then falling from ~2e-3, lowest at 5e-2..1e-1, blowing up at 2e-1, alike in every seed.

The rule (`RULE`): smooth the losses (an exponential moving average, bias-corrected); the loss has risen
once its smoothed value is RISE above the lowest so far (or is not finite; no rise counts before step
FIRST_RISE), and the test stops there; the pick is a twentieth of the highest rate before that rise.
Not "a tenth of the rate at the lowest loss": the sentiment LoRA's rate has a cliff (5e-3 learns, 1e-2
stays at chance) just a tenth below its lowest point, so the rule must err low. Measured (3 seeds, 16
steps; `python benchmarks/time_to_accuracy.py` shows the run's curves): the sentiment LoRA picks 5e-3 each
time (hand-tuned 5e-3); the digits CNN 5e-3, 2.3e-3 and 1.1e-3 (hand-tuned 3e-3; batch norm on one batch
blows up sooner in some seeds). The curve, the rule and the pick are written to <run>/lr_find.json (the
job page draws it) and the log; the test's seconds are in the `lr_found` event and, as all of the
process's time, in the run's wall time and cost.
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
    from gpuforge.train.trainer import Trainer

log = logging.getLogger("gpuforge.train")

STEPS = 16
MIN_LR, MAX_LR = 1e-5, 1.0  # LoRA, fresh heads and models from scratch: 1e-3..1e-2; full fine-tuning ~1e-4
RISE = 0.05  # the smoothed loss this far above its lowest so far: the rate is past what training takes
FIRST_RISE = 3  # a rise before this step is noise (dropout, Adam's first, unscaled updates)
DIVISOR = 20
SMOOTHING = 0.6  # weight of the past in the moving average: a few steps' noise, not the curve's shape
PLACEHOLDER_LR = 1e-3  # what the optimizer is built with before the test (or a checkpoint) sets the rate
RULE = f"a {DIVISOR}th of the highest rate before the smoothed loss rose {RISE:.0%} above its lowest"


@dataclass
class RangeTest:
    """The test's record, as lr_find.json holds it."""

    lr: float  # the pick
    rule: str
    reason: str  # one line: the pick and where it came from
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    steps: int  # run (fewer than planned once the loss rose)
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


def rise_at(losses: list[float]) -> int | None:
    """The index of the first step at which the smoothed loss rose RISE above its lowest before (or the
    loss is not finite); None while it has not."""
    lowest = math.inf
    for i, (loss, smoothed) in enumerate(zip(losses, smooth(losses), strict=True)):
        if not math.isfinite(loss) or (i >= FIRST_RISE and smoothed > lowest * (1 + RISE)):
            return i
        lowest = min(lowest, smoothed)
    return None


def pick(lrs: list[float], losses: list[float]) -> tuple[float, str]:
    """The rule applied to a curve: (rate, why)."""
    rose = rise_at(losses)
    below = (len(losses) if rose is None else rose) - 1  # the highest rate before the rise
    if below < 1:  # the loss was not finite at once: even the lowest rates move too far
        chosen = (lrs[0] if lrs else MIN_LR) / DIVISOR
        return chosen, f"lr {chosen:.3g}: a {DIVISOR}th of the lowest rate tried; the loss rose at once"
    chosen, at = lrs[below] / DIVISOR, lrs[below]
    if rose is None:
        return (
            chosen,
            f"lr {chosen:.3g}: a {DIVISOR}th of the highest rate tried ({at:.3g}); the loss never rose",
        )
    return chosen, f"lr {chosen:.3g}: {RULE} ({at:.3g}; it rose at {lrs[rose]:.3g})"


def find_lr(t: Trainer) -> RangeTest:
    """Run the range test on the trainer's model and data and put everything back; the record. A signal
    waits for its end (a few seconds): a rate from a cut curve would be kept by the checkpoint the signal
    writes, and the processes of a distributed job would leave the test at different steps."""
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
            indices = t.ranks.share(job.order.batch(0))  # one batch: the loss moves with the rate alone
            loss, *_ = forward_backward(
                job.built, job.task, job.data.train, indices, job.micro, t.amp, t.parallel,
                job.order.global_batch,
            )  # fmt: skip
            if t.ranks.world > 1:
                loss = t.ranks.sum([loss], job.device)[0]
            lrs.append(lr)
            losses.append(loss)
            if rise_at(losses) is not None:
                break  # past the rise the rule reads nothing
            t.amp.step(
                optimizer, trained, t.spec.train.grad_clip
            )  # refused (inf norm): the next step shows it
            optimizer.zero_grad(set_to_none=True)
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        _restore(module, saved)
        set_rng_state(rng)
        if scaler is not None:
            t.amp.scaler.load_state_dict(scaler)
        _forget_compression(t.parallel.hook_state)
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


def _forget_compression(state) -> None:
    """DDP's gradient compression as if the test had not run: PowerSGD's error feedback and warm-started Q
    (the test's last residual would join step 1's gradient), its step count (compression starts at
    powersgd_start_step of the run's steps), and the bytes counted (not step 1's)."""
    if state is None:
        return
    state.iter, state.generator = 0, None
    state.memory.clear()
    state.counter.pop()


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of what the test changes: the trained weights and the buffers (batch norm's statistics), in
    host memory (a GPU's is the batch's: full fine-tuning would double the weights' share of it)."""
    kept = {n: p for n, p in module.named_parameters() if p.requires_grad}
    kept.update(dict(module.named_buffers()))
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in kept.items()}


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
    """Steps the range test adds before a fresh run's first (at most: it stops once the loss rises): what
    `gpuforge plan` counts in the run's time and cost."""
    return STEPS if train.lr == "auto" else 0


def initial_lr(lr: float | str) -> float:
    """train.lr as the optimizer is first built with: the number, or for auto a placeholder that the
    range test (or the checkpoint's optimizer state) replaces."""
    return PLACEHOLDER_LR if lr == "auto" else float(lr)
