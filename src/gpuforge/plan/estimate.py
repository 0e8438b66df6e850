"""The step time on this machine's device: one owner for `plan`, `plan --measure` and `plan --compare`'s row
for it, so that the three print one figure.

    traces = Traces(job)                       # one real step of the job, traced op by op
    local = local_step(job, traces, machine()) # its roofline on this device's measured figures: an estimate
    local = local_step(job, traces, machine(), _measure_steps(job))   # with --measure: the measured median

Without --measure the figure is the traced step on the roofline `gpuforge hw` measured here, over the share
of that roofline our reference step reaches (hardware/machine.py): an estimate, not a bound. Only where this
device has no such figures is it FLOPs over the measured matmul peak, and then it says it is a lower bound.
The run's time beyond its steps comes from here too: the evaluations (a traced pass over the eval set on the
same roofline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpuforge.errors import GpuforgeError
from gpuforge.hardware.machine import DeviceFigures, Machine
from gpuforge.hardware.roofline import OpTrace, Roof
from gpuforge.runtime import tasks
from gpuforge.runtime.evaluate import eval_batch_size, to_device
from gpuforge.runtime.precision import MixedPrecision, autocast
from gpuforge.train.lr_find import initial_lr
from gpuforge.train.setup import Job
from gpuforge.train.step import forward_backward, make_optimizer

if TYPE_CHECKING:
    from gpuforge.plan import StepTiming  # the package imports this module: a cycle at run time

TRACED_MICRO_STEPS = 3  # micro-batches of different lengths: the estimate is their mean


class Traces:
    """One optimizer update and a few micro-batches of the job, traced here once, at the job's precision
    (a LoRA base is already cast to it), and one batch of its evaluation: every device's time comes from
    these same operations."""

    def __init__(self, job: Job):
        self.job = job
        self._traced: tuple[list[OpTrace], OpTrace] | None = None
        self._eval: tuple[OpTrace, int] | None = None

    def get(self) -> tuple[list[OpTrace], OpTrace]:
        if self._traced is None:
            self._traced = self._trace()
        return self._traced

    def _trace(self) -> tuple[list[OpTrace], OpTrace]:
        job = self.job
        amp = MixedPrecision(job.precision, job.device)
        module = job.module
        optimizer = make_optimizer(
            module, initial_lr(job.spec.train.lr), job.spec.train.weight_decay, job.device
        )
        params = list(module.parameters())

        def micro_step(step: int) -> None:
            indices = job.order.batch(step)[: job.micro]
            forward_backward(job.built, job.task, job.data.train, indices, job.micro, amp)

        def update() -> None:
            amp.step(optimizer, module.parameters(), job.spec.train.grad_clip)
            optimizer.zero_grad(set_to_none=True)

        # the weights change here: the plan's job is its own copy, never trained on afterwards
        with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
            micro_step(0)
            update()  # warm-up: kernels' first use; the optimizer's state exists before its update is traced
            micros = [OpTrace.of(lambda s=s: micro_step(s), params) for s in range(1, 1 + TRACED_MICRO_STEPS)]
            optimizer_step = OpTrace.of(update, params, batch_free=True)
        return micros, optimizer_step

    def parts(self, roof: Roof, micro: int, grad_accum: int) -> dict[str, float]:
        """Seconds of one optimizer step on `roof`, in the roofline's parts (each over its efficiency)."""
        micros, update = self.get()
        scale = micro / self.job.micro
        out = dict.fromkeys(("compute_s", "memory_s", "overhead_s"), 0.0)
        for t in micros:
            for k, v in t.parts(roof, scale).items():
                out[k] += v * grad_accum / len(micros) / roof.step_efficiency
        for k, v in update.parts(roof).items():
            out[k] += v / roof.step_efficiency
        return out

    def step_s(self, roof: Roof, micro: int, grad_accum: int) -> float:
        return sum(self.parts(roof, micro, grad_accum).values())

    def evaluation_s(self, roof: Roof, micro: int, examples: int | None = None) -> float:
        """Seconds of one pass over `examples` of the eval set (default: all) on `roof`, in the batches the
        run's evaluation takes with training micro-batches of `micro`; 0 for a job without one."""
        data = self.job.data.eval
        if data is None or len(data) == 0:
            return 0.0
        if self._eval is None:
            self._eval = self._trace_eval()
        trace, traced = self._eval
        examples = len(data) if examples is None else min(examples, len(data))
        batch = eval_batch_size(micro, examples)
        full, rest = divmod(examples, batch)
        seconds = full * trace.seconds(roof, batch / traced)
        return seconds + (trace.seconds(roof, rest / traced) if rest else 0.0)

    def all_evaluations_s(self, roof: Roof, micro: int) -> float:
        """Every evaluation of the run: train.eval_max_examples examples each but the last (the whole set)."""
        count = evaluations(self.job)
        if not count:
            return 0.0
        sample = self.job.spec.train.eval_max_examples
        return (count - 1) * self.evaluation_s(roof, micro, sample) + self.evaluation_s(roof, micro)

    def _trace_eval(self) -> tuple[OpTrace, int]:
        """One eval batch's forward, as runtime/evaluate.py runs it (no gradients, under autocast)."""
        job, data = self.job, self.job.data.eval
        n = eval_batch_size(job.micro, len(data))
        batch = to_device(data.collate(list(range(n))), job.device)
        module = job.module

        def forward() -> None:
            tasks.forward(job.built, job.task, batch)

        module.eval()
        try:
            with torch.inference_mode(), autocast(job.precision, job.device):
                forward()  # warm-up: kernels' first use
                trace = OpTrace.of(forward, list(module.parameters()))
        finally:
            module.train()
        return trace, n


@dataclass(frozen=True)
class LocalStep:
    """One optimizer step's time on the job's own device, and what that figure is."""

    roofline_s: float | None  # the traced step on this device's measured roofline; None: no figures here
    bound_s: float  # FLOPs over the measured matmul peak: no step can be faster
    timing: StepTiming | None = None  # with --measure: real steps of the job

    @property
    def seconds(self) -> float:
        if self.timing is not None:
            return self.timing.median_s
        return self.roofline_s if self.roofline_s is not None else self.bound_s

    @property
    def kind(self) -> str:
        """One of: measured, estimate (the calibrated roofline), lower bound (FLOPs at the matmul peak)."""
        if self.timing is not None:
            return "measured"
        return "estimate" if self.roofline_s is not None else "lower bound"

    @property
    def factor(self) -> float:
        """What real time is to the roofline's here: 1 until steps were measured."""
        if self.timing is None or not self.roofline_s:
            return 1.0
        return self.timing.median_s / self.roofline_s

    def method(self) -> str:
        from gpuforge.plan import duration  # the package imports this module: not at its top

        if self.timing is not None:
            said = self.timing.method()
            if self.roofline_s is not None:
                said += f"; estimated {duration(self.roofline_s)} without measuring"
            return said
        if self.roofline_s is not None:
            return (
                "an estimate: the job's traced step on this device's roofline (gpuforge hw), "
                "at the share of it a real step reaches here; --measure times real steps"
            )
        return "a lower bound: FLOPs / measured matmul peak (no gpuforge hw figures for this device)"


def local_step(
    job: Job, traces: Traces, here: Machine | None, bound_s: float, timing: StepTiming | None = None
) -> LocalStep:
    """The step time on the job's device: the roofline where this machine measured the device (`here`),
    the measured median where steps were timed (`timing`), the FLOP bound only where neither is known."""
    figures = local_figures(here, job) if here is not None else None
    roofline = None
    if figures is not None:
        accum = math.ceil(job.order.global_batch / job.micro)
        roofline = traces.step_s(figures.roof(job.precision.name), job.micro, accum)
    return LocalStep(roofline, bound_s, timing)


def local_evaluations_s(job: Job, traces: Traces, here: Machine) -> float:
    """Every evaluation of the run on the roofline the step's estimate uses; 0 where there is none (or
    no figures for this device: nothing to estimate it on)."""
    figures = local_figures(here, job)
    if figures is None:
        return 0.0
    return traces.all_evaluations_s(figures.roof(job.precision.name), job.micro)


def local_figures(here: Machine, job: Job) -> DeviceFigures | None:
    return next((d for d in here.devices if d.type == job.device.type), None)


def require_local_figures(here: Machine, job: Job) -> DeviceFigures:
    found = local_figures(here, job)
    if found is None:
        raise GpuforgeError(f"gpuforge hw has no figures for this job's device ({job.device.type})")
    return found


def evaluations(job: Job) -> int:
    """How many times the run evaluates: every train.eval_every steps and at the last step
    (train/trainer.py's evaluate_if_due); none without an eval set."""
    if job.data.eval is None or len(job.data.eval) == 0:
        return 0
    every, total = job.spec.train.eval_every, job.total_steps
    if not every:
        return 1
    return total // every + (1 if total % every else 0)
