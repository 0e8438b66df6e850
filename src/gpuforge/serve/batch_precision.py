"""The precision a classifier's batches run in: weights cast once, and `auto` measured on the served model.

    plan = plan_precision("auto", candidate, module, timed, max_batch=32, alone=True)
    module, precision = plan.for_batch(len(batch))        # in the model thread, per batch
    plan.describe()                                       # GET /info's precision_choice

A lower precision (bf16, fp16) serves a copy of the model whose nn.Linear weights are cast once, at load;
its batches still run under autocast, so layer norms and softmax stay in fp32. Autocast over fp32 weights
casts each Linear's weight to the same values at every forward: the answers are the same, the work per
batch less (MiniLM on a 2-core Xeon with AMX, batch 1: 7.5 ms with autocast over fp32 weights, 4.4 ms with
them cast once, 5.4 ms in fp32). The copy shares every tensor that is not a Linear's with the fp32 model.

`auto`: runtime/precision.py names the candidate (bf16 on a GPU with it, or on a CPU whose bf16 matmul is
faster); it is then timed against fp32 on the served model itself, at batch sizes 1, 2, 4, ... max_batch
(alternating, the least of several; sizes past TIMED_MAX run as the largest timed): a small batch can be
slower in bf16 on a CPU whose bf16 wins only on large matmuls. The lower precision serves from the
smallest size at which it was faster (by 5%) there and at every size above; below it, fp32 does. Where it
wins at every size, only the cast copy is kept; where it wins at none, only the fp32 model. So `auto` is
never slower than fp32 at a size it measured.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuforge.runtime.precision import Precision

FP32 = Precision("fp32", "")
ROUNDS = 5  # timings per size and precision, alternating; the least counts (a neighbour only adds time)
WIN = 0.95  # the lower precision takes a size only where it was 5% faster: one noisy run keeps no copy
TIMED_MAX = 256  # the largest batch size timed (a deployment may ask for 1024: its load stays short)
Timed = Callable[[torch.nn.Module, Precision, int], None]  # one batch of n made-up inputs, run to its end


@dataclass
class PrecisionPlan:
    """Batches of `switch` inputs and more run `module` in `precision`; smaller ones `small` in fp32."""

    module: torch.nn.Module
    precision: Precision
    switch: int = 1
    small: torch.nn.Module | None = None  # the fp32 model, for batches under `switch` inputs
    measured_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # size -> precision -> ms

    def for_batch(self, size: int) -> tuple[torch.nn.Module, Precision]:
        if self.small is not None and size < self.switch:
            return self.small, FP32
        return self.module, self.precision

    def describe(self) -> dict[str, Any]:
        """What runs which batches, why, and the timings that decided it (auto)."""
        low = self.precision.name
        if self.small is None:
            rule = f"{low} for every batch"
        else:
            rule = f"fp32 for batches under {self.switch} inputs, {low} from {self.switch}"
        return {"rule": rule, "reason": self.precision.reason, "measured_ms": self.measured_ms or None}


def lowered(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `module` whose nn.Linear weights (and biases) are `dtype`, cast as they are copied (the
    fp32 copies never exist at once); every other tensor shared. A Linear whose weight is another module's
    too (tied to an embedding) is shared as it is, and so is a tensor that is not floating point (a packed
    4-bit base): casting either would change the original, or its meaning."""
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    memo: dict[int, Any] = {}  # deepcopy's: what each original tensor becomes in the copy
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear):
            for tensor in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                memo[id(tensor)] = tensor
    for m in linears:
        tensors = list(m.parameters(recurse=False))
        if any(id(t) in memo for t in tensors):
            continue  # tied
        for t in tensors:
            memo[id(t)] = torch.nn.Parameter(t.detach().to(dtype), False) if t.is_floating_point() else t
    return copy.deepcopy(module, memo)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch itself, up to TIMED_MAX (a larger batch runs as the largest timed)."""
    largest = min(max_batch, TIMED_MAX)
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return [*sizes, largest]


def plan_precision(
    requested: str,
    candidate: Precision,
    module: torch.nn.Module,
    timed: Timed | None,
    max_batch: int,
    alone: bool = False,
    castable: bool = True,
) -> PrecisionPlan:
    """How batches run for a `requested` precision (auto | bf16 | fp16 | fp32), `candidate` being what
    runtime/precision.py picks for it on this device. `timed` runs one made-up batch (auto measures with
    it; None: no inputs can be made up, auto serves the candidate); `alone`: one copy of the model only
    (the adapters' PEFT model is changed in place while it serves); `castable` False: quantized weights
    (--quantize, a compressed variant, a 4-bit QLoRA base), left as they are, the candidate by autocast
    alone and not timed (--quantize measures its accuracy change in that precision)."""
    dtype = candidate.autocast_dtype
    if dtype is None or not castable:
        return PrecisionPlan(module, candidate)
    low = lowered(module, dtype)
    if requested != "auto" or timed is None:
        return PrecisionPlan(low, candidate)
    return measured_plan(candidate, module, low, timed, max_batch, alone)


def measured_plan(
    candidate: Precision,
    fp32: torch.nn.Module,
    low: torch.nn.Module,
    timed: Timed,
    max_batch: int,
    alone: bool = False,
) -> PrecisionPlan:
    """`auto`'s plan: `low` (the model for `candidate`) against `fp32`, timed at each batch size."""
    measured = _measure(fp32, low, candidate, timed, batch_sizes(max_batch))
    switch = takes_over(measured, candidate.name)
    if switch is not None and (switch == 1 or not alone):
        how = "at every size measured" if switch == 1 else f"from batch {switch}"
        reason = f"auto: {candidate.name} measured faster than fp32 on the served model {how}"
        small = fp32 if switch > 1 else None
        return PrecisionPlan(low, Precision(candidate.name, reason), switch, small, measured)
    if switch is None:
        why = f"{candidate.name} measured not faster than fp32 at the largest batch"
    else:
        why = f"{candidate.name} faster only from batch {switch}, and adapters allow one copy of the model"
    reason = f"auto: fp32 on the served model: {why}"
    return PrecisionPlan(fp32, Precision("fp32", reason), measured_ms=measured)


def takes_over(measured: dict[int, dict[str, float]], low: str) -> int | None:
    """The least batch size from which `low` was faster than fp32 (by 1 - WIN) at every size measured;
    None: none."""
    sizes = sorted(measured)
    faster = [measured[n][low] < WIN * measured[n]["fp32"] for n in sizes]
    return next((n for i, n in enumerate(sizes) if all(faster[i:])), None)


def _measure(
    fp32: torch.nn.Module, low: torch.nn.Module, precision: Precision, timed: Timed, sizes: list[int]
) -> dict[int, dict[str, float]]:
    measured: dict[int, dict[str, float]] = {}
    for n in sizes:
        runs: dict[str, list[float]] = {"fp32": [], precision.name: []}
        for module, p in ((fp32, FP32), (low, precision)):
            timed(module, p, n)  # lazy set-up at this shape is not timed
        for _ in range(ROUNDS):
            for module, p in ((fp32, FP32), (low, precision)):
                began = time.perf_counter()
                timed(module, p, n)
                runs[p.name].append(1000 * (time.perf_counter() - began))
        measured[n] = {name: round(min(ms), 3) for name, ms in runs.items()}
    return measured
