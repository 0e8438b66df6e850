"""A short fine-tune after one-shot pruning, on the run's own training data, keeping pruned weights zero.

It reuses the engine's pieces (micro-batched forward/backward, fused AdamW, the guarded optimizer step,
the seeded batch order) in a plain loop: no checkpoints or run directory, since it lasts seconds to
minutes and its result is saved as the compressed artifact. After every optimizer step the pruning masks
are applied again, because AdamW's momentum would otherwise grow the zeros back.
"""

from __future__ import annotations

import logging
import math

import torch

from gpuforge.data.batches import BatchOrder
from gpuforge.errors import TrainingFailed
from gpuforge.models.base import BuiltModel
from gpuforge.runtime.precision import MixedPrecision, choose_precision
from gpuforge.spec import JobSpec
from gpuforge.train.schedule import Shape, make_scheduler
from gpuforge.train.setup import seed_everything
from gpuforge.train.step import forward_backward, make_optimizer

log = logging.getLogger("gpuforge.compress")

RECOVER_BATCH = 32  # when the run's batch size was `auto`


def recover(
    built: BuiltModel,
    spec: JobSpec,
    train_data,
    steps: int,
    lr: float,
    masks: dict[str, torch.Tensor],
) -> list[float]:
    """Train every float parameter for `steps` steps (warm-up then cosine), re-masking after each; the
    losses. The model is left in eval mode with no gradients."""
    device = torch.device("cpu")
    seed_everything(spec.train.seed)  # dropout masks and batches: the same variant every time
    module = built.module
    params = dict(module.named_parameters())
    for p in params.values():
        p.requires_grad_(p.is_floating_point())
    module.train()
    optimizer = make_optimizer(module, lr, spec.train.weight_decay, device)
    shape = Shape("cosine", max(1, steps // 10), steps, spec.train.min_lr_ratio, "recovery")
    scheduler = make_scheduler(optimizer, shape)
    batch = spec.train.batch_size if isinstance(spec.train.batch_size, int) else RECOVER_BATCH
    order = BatchOrder(len(train_data), batch, spec.train.seed)
    # no loss scaling, even for fp16: as this fine-tune has always run (a scaler would change its numerics)
    amp = MixedPrecision(choose_precision(spec.train.precision, device), device, loss_scaling=False)
    losses = []
    for step in range(steps):
        loss, *_ = forward_backward(built, spec.model.task, train_data, order.batch(step), batch, amp)
        if not math.isfinite(loss):
            raise TrainingFailed(f"recovery fine-tune: loss is {loss} at step {step + 1}")
        refused = amp.step(optimizer, module.parameters(), spec.train.grad_clip)
        if refused is not None:
            raise TrainingFailed(f"recovery fine-tune: {refused} at step {step + 1}")
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        with torch.no_grad():
            for name, mask in masks.items():
                params[name].mul_(mask)
        losses.append(loss)
        if (step + 1) % max(1, steps // 5) == 0:
            log.info("recovery step %d/%d: loss %.4f", step + 1, steps, loss)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return losses
