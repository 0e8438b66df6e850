"""What a model's training state holds in memory, beside its weights: shared by the training loop's
figures and the data-parallel wrappers' (which count each rank's shard)."""

from __future__ import annotations

import torch


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer keeps (AdamW: two moments per trainable parameter, plus step counters)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
