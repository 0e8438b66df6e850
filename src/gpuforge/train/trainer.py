"""The training loop's parts: what stays fixed from the first step to the last (Trainer), what changes
from step to step (LoopState), and what happens at each step: the optimizer step, evaluation, the metrics
line, checkpoints and the decision to stop. engine.py strings them together.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from gpuforge.distributed.parallel import Parallel, wrap
from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import SpecError
from gpuforge.hardware.bench import peak_flops
from gpuforge.hardware.energy import StepEnergy
from gpuforge.hardware.probe import is_out_of_memory, peak_memory_bytes, release_memory, reset_peak_memory
from gpuforge.runs import RunDir
from gpuforge.runtime.device_share import memory_cap, over_cap_words
from gpuforge.runtime.evaluate import eval_batch_size, evaluate, to_device
from gpuforge.runtime.phases import phase
from gpuforge.runtime.precision import MixedPrecision
from gpuforge.spec import JobSpec
from gpuforge.train.checkpoint import (
    load_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    save_weights,
    set_rng_state,
)
from gpuforge.train.early_stop import Watch
from gpuforge.train.lr_find import initial_lr
from gpuforge.train.metrics import FlopModel, Meter, StepClock, usd
from gpuforge.train.progress import Reporter
from gpuforge.train.schedule import Shape, make_scheduler
from gpuforge.train.setup import Job, seed_everything
from gpuforge.train.signals import StopFlag
from gpuforge.train.step import forward_backward, make_optimizer

log = logging.getLogger("gpuforge.train")


@dataclass
class LoopState:
    """What the loop changes as it goes; the summary is made from it."""

    micro: int  # examples per forward/backward; an out-of-memory error halves it
    start_step: int = 0  # steps done before this process: the checkpoint it resumed from
    resumed_from: int | None = None
    cost_before: float = 0.0  # dollars the processes before this one spent
    step: int = 0  # the step under way; after the loop, the last one begun
    status: str = "finished"  # failed | cancelled | paused when the loop ended early, with a reason
    reason: str | None = None
    loss: float = math.nan  # of the last step
    last_eval: dict[str, float] | None = None
    sampled_at: int | None = None  # the step whose evaluation read train.eval_max_examples' sample
    samples_done: int = 0  # in this process's steps, every rank's
    tokens_done: int = 0
    comm_bytes_done: int = 0
    train_seconds: float = 0.0  # in steps only, evaluation and checkpoints left out
    clock: StepClock = field(default_factory=StepClock)

    @property
    def done_step(self) -> int:
        """The last step whose update is good: a failed step's is not."""
        return self.step - 1 if self.status == "failed" else self.step

    def end(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason

    def count(self, seconds: float, samples: int, tokens: int, comm_bytes: int) -> None:
        self.clock.add(seconds)
        self.train_seconds += seconds
        self.samples_done, self.tokens_done = self.samples_done + samples, self.tokens_done + tokens
        self.comm_bytes_done += comm_bytes


@dataclass
class StepResult:
    """One optimizer step's figures (summed over the ranks) and the decisions its all-reduce shared."""

    lr: float
    loss: float
    samples: int
    tokens: int
    data_wait: float  # seconds spent fetching data
    seconds: float
    comm: dict[str, int]  # bytes handed to DDP's all-reduces, with compression and without
    stopping: bool  # a signal reached some process before the all-reduce
    over_budget: bool
    profile_steps: int = 0  # a profile of the next steps was asked for (the main process took the request)


@dataclass
class Trainer:
    """The parts of a run that stay from its first step to its last, and what they do at each step."""

    job: Job
    ranks: Ranks
    run: RunDir
    reporter: Reporter
    started: float  # time.perf_counter() when this process began: its cost and wall time count from it
    parallel: Parallel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    amp: MixedPrecision
    trained: list[torch.Tensor]  # the optimizer's parameters (LoRA: a few of many), whose norm is clipped
    shape: Shape  # the schedule: warm-up, then cosine, wsd or constant
    watch: Watch | None = None  # train.early_stop, stop_at, keep_best: None when the spec sets none
    energy: StepEnergy | None = None  # step_energy_j: set by start_meter (None where it cannot be read)
    energy_mark: int = 0  # the step the energy window began after
    energy_j: float = 0.0  # this process's run so far, over its windows (summary.json)
    energy_source: str | None = None  # the last window's source and rule

    @classmethod
    def build(
        cls,
        job: Job,
        ranks: Ranks,
        run: RunDir,
        reporter: Reporter,
        started: float,
        resumed: dict | None = None,
    ) -> Trainer:
        """Join the other processes and wrap (DDP) or shard (FSDP) the model before the optimizer sees it;
        then the optimizer, the schedule (`resumed`: the meta of the checkpoint the run resumes from, which
        keeps its schedule) and the loss scaling."""
        spec, device = job.spec, job.device
        if ranks.launched and spec.distributed.strategy != "none":  # a single rank too: NCCL/gloo, hooks
            ranks.start(device, spec.distributed.timeout_s)
        if ranks.world > 1:
            if job.order.global_batch < ranks.world:  # BatchOrder caps the batch at the data set's size
                raise SpecError(
                    f"data.train: {len(job.data.train)} examples, fewer than the {ranks.world} processes "
                    "(resources.devices) that would share each step's batch"
                )
            # the same micro-batch everywhere (an automatic search may differ by rank): FSDP's forwards
            # all-gather, so every rank must run as many of them a step
            job.micro = int(ranks.minimum(job.micro, device))
        parallel = wrap(job.module, spec.distributed, ranks, device, seed=spec.train.seed)
        if ranks.rank > 0:
            seed_everything(spec.train.seed + ranks.rank)  # weights alike already; dropout masks must differ
        # lr auto: a placeholder, which the range test (find_lr) or the checkpoint's state replaces
        optimizer = make_optimizer(parallel.model, initial_lr(spec.train.lr), spec.train.weight_decay, device)
        if resumed is not None:
            shape = Shape.kept(resumed.get("schedule"), spec.train, job.total_steps)
        else:
            shape = Shape.of(spec.train, what_trains(job), job.total_steps)
        scheduler = make_scheduler(optimizer, shape)
        trained = [p for group in optimizer.param_groups for p in group["params"]]
        amp = MixedPrecision(job.precision, device)
        watch = Watch.from_spec(spec.train)
        return cls(
            job, ranks, run, reporter, started, parallel, optimizer, scheduler, amp, trained, shape, watch
        )

    def use_lr(self, lr: float) -> None:
        """The peak rate the range test picked, before the first step: the schedule starts again on it."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group.pop("initial_lr", None)  # LambdaLR keeps a group's first rate as its base
        self.scheduler = make_scheduler(self.optimizer, self.shape)

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def module(self) -> torch.nn.Module:
        """The model itself (sharded in place by FSDP): what checkpoints and evaluation read."""
        return self.parallel.model

    @property
    def usd_per_hour(self) -> float:
        # the price of one device, times those held (a fraction of one: that much of it)
        return self.spec.cost.usd_per_hour * (self.spec.resources.share or self.ranks.world)

    # --- the start ------------------------------------------------------------------------------------

    def resume(self, checkpoint: tuple[int, Path] | None) -> LoopState:
        """The loop's state at its start: fresh, or restored with the weights, optimizer, schedule, loss
        scale and RNG from `checkpoint` (step, path)."""
        state = LoopState(micro=self.job.micro)
        if checkpoint is not None:
            meta = load_checkpoint(
                checkpoint[1], self.module, self.optimizer, self.scheduler, self.amp, self.job.device,
                self.ranks.rank, self.ranks.world, sharded=self.parallel.strategy == "fsdp",
            )  # fmt: skip
            state.start_step = state.step = state.resumed_from = meta["step"]
            state.cost_before = meta.get("cost_usd", 0.0)
            if self.watch is not None:
                self.watch.load_state_dict(meta.get("early_stop"))
        if self.spec.train.keep_best and self.ranks.is_main:
            self._drop_best(keep=lambda step: step <= state.start_step)  # steps that run again write theirs
        return state

    @property
    def ended_early(self) -> bool:
        """early_stop or stop_at ended the run (as of the checkpoint it resumed from)."""
        return self.watch is not None and self.watch.state.stopped is not None

    def start_meter(self, start_step: int = 0) -> Meter:
        """FLOPs of a step (measured on the first micro-batch where no formula gives them) against the
        device's peak; the memory peak counts from here."""
        job = self.job
        first_batch = to_device(job.data.train.collate(job.order.batch(0)[: job.micro]), job.device)
        flops = FlopModel(job.built, job.task, first_batch, job.precision)
        meter = Meter(flops, peak_flops(job.device, job.precision.name), self.ranks.world)
        reset_peak_memory(job.device)
        try:  # the energy of each logged window, by the server's rules (the job's own figure, labelled)
            self.energy = StepEnergy.from_environment(kind=job.device.type)
            self.energy.window()  # the baseline
            self.energy_mark = start_step  # a resumed run's first window counts its own steps
        except ValueError as err:
            log.warning("no step_energy_j: %s", err)
        return meter

    # --- one step -------------------------------------------------------------------------------------

    def step(self, state: LoopState, step: int, stop: StopFlag, profile_asked: int = 0) -> StepResult | None:
        """One optimizer step: forward/backward over the step's global batch, then clip and update. None
        when the step failed (state.reason says why): no update was made. `profile_asked`: steps a profile
        request asks for, which the step's all-reduce shares with every process."""
        state.step = step
        began = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        gradients = self._gradients(state, step)
        if gradients is None:
            capped = memory_cap() if self.job.device.type == "cuda" else None
            if capped is not None:  # its share's cap, not the device: a smaller batch is the user's call
                state.end("failed", f"out of memory at step {step}: over {over_cap_words(capped)}")
            else:
                state.end("failed", f"out of memory at step {step} even with a micro-batch of 1")
            return None
        loss, samples, tokens, data_wait = gradients
        stopping, over_budget = stop.signal_name is not None, self.over_budget(state)
        if self.ranks.world > 1:  # one all-reduce: the step's figures, and decisions every rank shares
            with phase("sync"):
                loss, samples, tokens, stops, overs, asked = self.ranks.sum(
                    [loss, samples, tokens, float(stopping), float(over_budget), float(profile_asked)],
                    self.job.device,
                )
            samples, tokens, stopping, over_budget = int(samples), int(tokens), stops > 0, overs > 0
            profile_asked = round(asked)
        state.loss = loss
        if not math.isfinite(loss):
            state.end("failed", f"loss is {loss} at step {step}")
            return None
        with phase("optimizer"):
            refused = self.amp.step(self.optimizer, self.trained, self.spec.train.grad_clip)
            if refused is None:
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
        if refused is not None:
            state.end("failed", f"{refused} at step {step}")
            return None
        comm = self.parallel.pop_comm()
        seconds = time.perf_counter() - began
        state.count(seconds, samples, tokens, comm.get("comm_bytes", 0))
        return StepResult(
            lr, loss, samples, tokens, data_wait, seconds, comm, stopping, over_budget, profile_asked
        )

    def _gradients(self, state: LoopState, step: int) -> tuple[float, int, int, float] | None:
        """forward_backward over this process's share of the step's batch. Out of memory in a process
        alone, the step runs again in micro-batches half as big (the same global batch and dropout masks,
        so the same loss curve); None when not even one example fits."""
        job = self.job
        indices, rng_at_start = self.ranks.share(job.order.batch(step - 1)), rng_state()
        while True:
            try:
                return forward_backward(
                    job.built, job.task, job.data.train, indices, state.micro, self.amp, self.parallel,
                    job.order.global_batch,
                )  # fmt: skip
            except Exception as err:
                if not is_out_of_memory(err) or self.ranks.world > 1:
                    raise  # several processes: a retry on one alone would desynchronise them
                capped = memory_cap() is not None and self.job.device.type == "cuda"
            if capped:  # over its fraction's cap: failed with the cap named, never retried as a plain OOM
                self.optimizer.zero_grad(set_to_none=True)
                release_memory(job.device)
                return None
            # out of the except block: the error's traceback no longer holds the failed step's tensors
            self.optimizer.zero_grad(set_to_none=True)
            release_memory(job.device)
            if state.micro == 1:
                return None
            state.micro //= 2  # the same global batch in more micro-batches
            set_rng_state(rng_at_start)  # the retried step draws the same dropout masks
            accum = math.ceil(job.order.global_batch / state.micro)
            self.run.event(
                "retry", step=step, reason="out of memory", micro_batch=state.micro, grad_accum=accum
            )
            log.warning("out of memory at step %d: retrying with micro-batch %d", step, state.micro)

    # --- after the step: evaluate, log, checkpoint, stop ---------------------------------------------

    def evaluate_if_due(self, state: LoopState) -> dict[str, float] | None:
        """The eval set's figures every eval_every steps and at the last step; None at other steps.
        train.eval_max_examples: the evaluations before the last read its sample."""
        job, every = self.job, self.spec.train.eval_every
        due = state.step == job.total_steps or (every and state.step % every == 0)
        if job.data.eval is None or not due:
            return None
        sampled = self.eval_sample is not None and state.step != job.total_steps  # the last: the whole set
        state.last_eval = self._evaluate(state.micro, self.eval_sample if sampled else None)
        state.sampled_at = state.step if sampled else None
        return state.last_eval

    def _evaluate(self, micro: int, sample: list[int] | None) -> dict[str, float]:
        job, alone = self.job, self.ranks.world == 1
        eval_shards = self.ranks if self.parallel.strategy == "ddp" else None  # FSDP: every rank every batch
        batch = eval_batch_size(micro, len(job.data.eval), self.ranks.world)
        figures = evaluate(
            job.built, job.task, job.data.eval, batch, job.precision, job.device, eval_shards, sample, alone
        )
        self.module.train()
        return figures

    @cached_property
    def eval_sample(self) -> list[int] | None:
        """train.eval_max_examples: the held-out examples evaluations before the last read, the same every
        time (seeded by train.seed), so their figures compare; None: the whole set."""
        most, data = self.spec.train.eval_max_examples, self.job.data.eval
        if most is None or data is None or len(data) <= most:
            return None
        generator = torch.Generator().manual_seed(self.spec.train.seed)
        return sorted(torch.randperm(len(data), generator=generator)[:most].tolist())

    def judge(self, state: LoopState, evaluation: dict[str, float]) -> bool:
        """An evaluation against train.early_stop and stop_at (only where the spec sets them): True when the
        run ends here (finished, with the reason); keep_best keeps the weights of the best so far. Every
        process reads the same figures (summed over DDP's shards), so every one decides alike."""
        assert self.watch is not None
        decision = self.watch.observe(state.step, {f"eval_{k}": v for k, v in evaluation.items()})
        if decision.best and self.spec.train.keep_best and self.ranks.is_main:
            save_weights(self.best_path(state.step), self.module, self.job.built.adapter)
        if decision.stop is None or state.step == self.job.total_steps:  # the last step ends it anyway
            return False
        self.watch.state.stopped = decision.stop
        state.end("finished", decision.stop)
        if state.sampled_at == state.step:  # the run's last evaluation, in its summary: the whole set's
            state.last_eval = self._evaluate(state.micro, None)
        return True

    def best_path(self, step: int) -> Path:
        """keep_best's copy of the weights evaluated at `step` (beside the checkpoints, not one of them)."""
        return self.run.checkpoints_dir / f"best-step-{step:06d}.safetensors"

    def _drop_best(self, keep) -> None:
        for path in self.run.checkpoints_dir.glob("best-step-*.safetensors"):
            if not keep(int(path.name.removeprefix("best-step-").removesuffix(".safetensors"))):
                path.unlink(missing_ok=True)

    def restore_best(self) -> int | None:
        """keep_best: the best evaluation's weights back into the model (its step), before it is saved;
        None where no evaluation was the best (the last step's weights stay)."""
        step = self.watch.state.best_step if self.watch is not None else None
        if step is None or not self.ranks.is_main:
            return None
        load_weights(self.best_path(step), self.module, self.job.device, self.job.built.adapter)
        return step

    def log_if_due(
        self, state: LoopState, result: StepResult, evaluation: dict[str, float] | None, meter: Meter
    ) -> dict[str, Any] | None:
        """A metrics.jsonl line every log_every steps, after an evaluation and at the last step: the record,
        or None at the steps between."""
        step, seconds = state.step, result.seconds
        if not (step % self.spec.train.log_every == 0 or evaluation or step == self.job.total_steps):
            return None
        record = {
            "step": step,
            "loss": result.loss,
            "lr": result.lr,
            "samples_per_s": result.samples / seconds,
            "tokens_per_s": result.tokens / seconds if result.tokens else None,
            "step_time_s": seconds,
            "data_wait_frac": result.data_wait / seconds,
            "peak_mem_bytes": peak_memory_bytes(self.job.device),
            "mfu": meter.mfu(result.samples, result.tokens, seconds),
            "cost_usd": self.spent(state),
            "step_cost_usd": usd(seconds, self.usd_per_hour),
            "eta_s": state.clock.eta(self.job.total_steps - step),
            **result.comm,
            **self._energy_since_last_line(step),
        }
        if evaluation:
            record.update({f"eval_{k}": v for k, v in evaluation.items()})
            if state.sampled_at == step:  # these figures are a sample's (train.eval_max_examples)
                record["evaluated_examples"] = len(self.eval_sample)
        self.run.metric(record)
        self.reporter.step(record)
        return record

    def _energy_since_last_line(self, step: int) -> dict[str, Any]:
        """step_energy_j: the energy since the last logged line over its steps, with its source and rule."""
        reading = self.energy.window() if self.energy is not None else None
        steps, self.energy_mark = step - self.energy_mark, step
        if reading is None or steps <= 0:
            return {}
        self.energy_j += reading.joules
        self.energy_source = f"{reading.source}: {reading.rule}"
        return {"step_energy_j": reading.joules / steps, "energy_source": self.energy_source}

    def checkpoint_if_due(self, state: LoopState) -> None:
        """Every checkpoint_every steps; the last step's checkpoint is the end's (summary.py)."""
        every = self.spec.train.checkpoint_every
        if every and state.step % every == 0 and state.step != self.job.total_steps:
            self.checkpoint(state, state.step)

    def checkpoint(self, state: LoopState, at_step: int) -> None:
        """Every rank takes part (RNG states, FSDP's shards); rank 0 writes."""
        rng_ranks = self.ranks.gather(rng_state()) if self.ranks.world > 1 else None
        full = self.parallel.full_states(self.optimizer)  # FSDP: gathered to rank 0
        if not self.ranks.is_main:
            return
        job = self.job
        meta = {
            "data_position": at_step,  # steps done; each step's global batch is fixed (batches.py)
            "micro_batch": state.micro,
            "global_batch": job.order.global_batch,
            "examples_seen": at_step * job.order.global_batch,
            "cost_usd": self.spent(state),
            "precision": job.precision.name,
            "processes": self.ranks.world,  # micro_batch was sized for this many shares
            "schedule": self.shape.recorded(),  # a resumed run keeps it, whatever auto resolves to later
        }
        if self.watch is not None:  # the best so far and the evaluations since: a resumed run judges alike
            meta["early_stop"] = self.watch.state_dict()
        path = save_checkpoint(
            self.run, at_step, self.module, self.optimizer, self.scheduler, self.amp, meta,
            keep=self.spec.train.keep_checkpoints, adapter=job.built.adapter, rng_ranks=rng_ranks,
            full_states=full,
        )  # fmt: skip
        self.run.event("checkpoint", step=at_step, path=str(path.relative_to(self.run.root)))
        if self.spec.train.keep_best:  # the checkpoint names the best: older bests are not needed again
            best = self.watch.state.best_step
            self._drop_best(keep=lambda step: step == best or step > at_step)

    def should_stop(self, state: LoopState, result: StepResult, stop: StopFlag) -> bool:
        """Stop after this step for a signal (cancelled) or a spent budget (paused: the same run directory
        with a higher budget goes on); a budget spent by the last step changes nothing."""
        alone = self.ranks.world == 1  # one process: decide as of now, not as of the step's all-reduce
        stopping = stop.signal_name is not None if alone else result.stopping
        if stopping:
            by = stop.signal_name or "a signal to another process of the job"
            state.end("cancelled", f"stopped by {by} at step {state.step}")
            return True
        over_budget = self.over_budget(state) if alone else result.over_budget
        if over_budget and state.step != self.job.total_steps:
            budget, spent = self.spec.cost.budget_usd, self.spent(state)
            state.end("paused", f"cost.budget_usd {budget:g} spent (${spent:.4f}) at step {state.step}")
            return True
        return False

    # --- cost -----------------------------------------------------------------------------------------

    def spent(self, state: LoopState) -> float:
        """Dollars so far: the processes before this one, and this one's time on its devices."""
        return state.cost_before + usd(time.perf_counter() - self.started, self.usd_per_hour)

    def over_budget(self, state: LoopState) -> bool:
        budget = self.spec.cost.budget_usd
        return budget is not None and self.spent(state) >= budget


def what_trains(job: Job) -> str:
    """What the default warm-up depends on (train/schedule.py): "lora", "scratch" or "full"."""
    if job.built.adapter:
        return "lora"
    return "full" if job.built.extra.get("pretrained") else "scratch"
