"""The training loop. It reads top to bottom: set-up, resume, the steps, the end.

    gpuforge train examples/digits-cnn.yaml --out runs/digits

It writes only the run directory (runs.py): no server, no database. Signals (SIGTERM, SIGINT) make it
checkpoint and stop cleanly; running it again on the same --out resumes from the newest checkpoint and
continues the same loss curve.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import yaml

from gpuforge.artifact import save_artifact
from gpuforge.data.batches import micro_batches
from gpuforge.distributed.parallel import Parallel, wrap
from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import RunDirError, SpecError, TrainingFailed
from gpuforge.hardware.bench import peak_flops
from gpuforge.hardware.probe import device_name, peak_memory_bytes, reset_peak_memory
from gpuforge.runs import ReaderRunDir, RunDir
from gpuforge.runtime import tasks
from gpuforge.runtime.evaluate import evaluate, to_device
from gpuforge.runtime.memory import optimizer_state_bytes
from gpuforge.runtime.precision import autocast, make_scaler
from gpuforge.spec import JobSpec
from gpuforge.train.batch import check_memory_budget
from gpuforge.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from gpuforge.train.metrics import FlopModel, StepClock, usd
from gpuforge.train.progress import Reporter
from gpuforge.train.schedule import make_scheduler
from gpuforge.train.setup import build_job, seed_everything

log = logging.getLogger("gpuforge.train")

# Keys that may differ between the spec of a stored run and the spec that resumes it.
RESUMABLE_CHANGES = {
    ("train", "max_steps"),
    ("train", "epochs"),
    ("name",),
    ("cost", "budget_usd"),
    ("resources", "devices"),  # the global batch of a step does not depend on how many processes share it
    ("distributed", "max_restarts"),
    ("distributed", "timeout_s"),
}


def train(spec: JobSpec, out: str | Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run a job to its end (or a signal, NaN loss, budget) and return its summary."""
    process_start = time.perf_counter()
    ranks = Ranks.from_env()  # world 1 unless launched as one of several processes (launch/job.py)
    if ranks.world > 1 and spec.distributed.strategy == "none":
        raise SpecError(
            f"launched as rank {ranks.rank} of {ranks.world} but distributed.strategy is none: every "
            "process would train its own copy into one run directory"
        )
    run = RunDir(out) if ranks.is_main else ReaderRunDir(out)
    run.check_usable()
    check_same_job(run, spec)
    reporter = reporter or Reporter()
    latest = run.latest_checkpoint()
    resume_meta = json.loads((latest[1] / "meta.json").read_text()) if latest else {}

    # --- device, precision, data, model, batch: everything that can fail on bad input, before any write ---
    job = build_job(spec, resume_meta, ranks)
    check_memory_budget(job)  # resources.max_memory: refused here with `gpuforge plan`'s verdict
    device, precision, task, built, module = job.device, job.precision, job.task, job.built, job.module
    data, tokenizer, order, search = job.data, job.tokenizer, job.order, job.search
    micro, total_steps = job.micro, job.total_steps
    if latest and latest[0] > total_steps:
        raise RunDirError(
            f"--out {run.root}: holds a run already at step {latest[0]}, past the {total_steps} steps "
            "asked for"
        )
    warmup = (
        spec.train.warmup_steps
        if spec.train.warmup_steps is not None
        else round(spec.train.warmup_ratio * total_steps)
    )

    # --- processes: join the others, wrap (DDP) or shard (FSDP) the model before the optimizer sees it ---
    if ranks.launched and spec.distributed.strategy != "none":  # a single rank too: NCCL/gloo, hooks
        ranks.start(device, spec.distributed.timeout_s)
    if ranks.world > 1:
        if order.global_batch < ranks.world:  # BatchOrder caps the batch at the data set's size
            raise SpecError(
                f"data.train: {len(data.train)} examples, fewer than the {ranks.world} processes "
                "(resources.devices) that would share each step's batch"
            )
        # the same micro-batch everywhere (an automatic search may differ by rank): FSDP's forwards
        # all-gather, so every rank must run as many of them a step
        micro = int(ranks.minimum(micro, device))
    parallel = wrap(module, spec.distributed, ranks, device, seed=spec.train.seed)
    eval_shards = ranks if parallel.strategy == "ddp" else None  # FSDP: every rank runs every eval batch
    module = parallel.model
    if ranks.rank > 0:
        seed_everything(spec.train.seed + ranks.rank)  # weights are alike already; dropout masks must differ

    # --- optimizer, schedule, loss scaling ---
    optimizer = make_optimizer(module, spec.train.lr, spec.train.weight_decay, device)
    trained = [p for group in optimizer.param_groups for p in group["params"]]  # LoRA: a few of many tensors
    scheduler = make_scheduler(optimizer, warmup, total_steps, spec.train.min_lr_ratio)
    scaler = make_scaler(precision, device)

    # --- resume from the newest checkpoint, if the run directory has one ---
    start_step, cost_before, resumed_from = 0, 0.0, None
    if latest is not None:
        meta = load_checkpoint(
            latest[1], module, optimizer, scheduler, scaler, device, ranks.rank, ranks.world,
            sharded=parallel.strategy == "fsdp",
        )  # fmt: skip
        start_step, cost_before, resumed_from = meta["step"], meta.get("cost_usd", 0.0), meta["step"]
        finished = run.summary()
        if start_step >= total_steps and finished and finished.get("status") == "finished":
            log.info("%s: already finished at step %d; nothing to do", run.root, start_step)
            return {**finished, "signal": None}
    if run.metrics_path.exists():
        run.truncate_metrics_after(start_step)  # steps a killed process logged past its checkpoint run again

    stop = StopFlag()
    with _running(run, spec, stop, ranks):
        log.info("job %s on %s (%s)", spec.name, device_name(device), device.type)
        log.info("precision %s: %s", precision.name, precision.reason)
        log.info(
            "model %s: %.2fM parameters (%.2fM trainable)",
            built.description,
            built.num_parameters / 1e6,
            built.num_trainable_parameters / 1e6,
        )
        log.info(
            "data: %d training and %d eval examples; %d per step in micro-batches of %d",
            len(data.train),
            len(data.eval) if data.eval else 0,
            order.global_batch,
            micro,
        )
        if resumed_from is not None:
            log.info("resuming from checkpoint step %d of %d", resumed_from, total_steps)
        if search is not None:
            log.info(
                "batch size auto: micro-batch %d (%.0f MiB per sample, %.2f of %.2f GiB budget: %s)",
                micro,
                search.per_sample_bytes / 2**20,
                search.predicted_bytes(micro) / 2**30,
                search.budget_bytes / 2**30,
                search.budget_source,
            )
        run.event(
            "started",
            step=start_step,
            total_steps=total_steps,
            device=device_name(device),
            precision=precision.name,
            resumed_from=resumed_from,
            micro_batch=micro,
            global_batch=order.global_batch,
            batch_search=search.as_dict() if search else None,
            processes=ranks.world,
            strategy=parallel.strategy,
            restart=ranks.restart,
            setup_s=round(
                time.perf_counter() - process_start, 3
            ),  # device, data, model, batch: before step 1
        )

        first_batch = to_device(data.train.collate(order.batch(0)[:micro]), device)
        flops = FlopModel(built, task, first_batch, precision)
        device_peak = peak_flops(device, precision.name)
        clock = StepClock()
        reset_peak_memory(device)
        rate = spec.cost.usd_per_hour * ranks.world  # the price of one device, times the devices held
        status, reason, step, loss_value = "finished", None, start_step, float("nan")
        last_eval: dict[str, float] | None = None
        samples_done = tokens_done = comm_bytes_done = 0
        train_seconds = 0.0

        def cost_so_far() -> float:
            return cost_before + usd(time.perf_counter() - process_start, rate)

        def checkpoint(at_step: int) -> None:
            rng_ranks = ranks.gather(rng_state()) if ranks.world > 1 else None  # every rank takes part
            full = parallel.full_states(optimizer)  # FSDP: gathered to rank 0, every rank taking part
            if not ranks.is_main:
                return
            path = save_checkpoint(
                run,
                at_step,
                module,
                optimizer,
                scheduler,
                scaler,
                {
                    "data_position": at_step,  # steps done; each step's global batch is fixed (batches.py)
                    "micro_batch": micro,
                    "global_batch": order.global_batch,
                    "examples_seen": at_step * order.global_batch,
                    "cost_usd": cost_so_far(),
                    "precision": precision.name,
                    "processes": ranks.world,  # micro_batch was sized for this many shares
                },
                keep=spec.train.keep_checkpoints,
                adapter=built.adapter,
                rng_ranks=rng_ranks,
                full_states=full,
            )
            run.event("checkpoint", step=at_step, path=str(path.relative_to(run.root)))

        reporter.start(total_steps, start_step)
        with _stopping(reporter):
            for step in range(start_step + 1, total_steps + 1):
                # --- one optimizer step: forward/backward over the global batch, then clip, step ---
                step_start = time.perf_counter()
                lr = scheduler.get_last_lr()[0]
                indices, rng_at_start = ranks.share(order.batch(step - 1)), rng_state()
                result = None
                while result is None:
                    try:
                        result = forward_backward(
                            built, task, data.train, indices, micro, precision, device, scaler,
                            parallel, order.global_batch,
                        )  # fmt: skip
                    except Exception as err:
                        if not is_out_of_memory(err) or ranks.world > 1:
                            raise  # several processes: a retry on one alone would desynchronise them
                        optimizer.zero_grad(set_to_none=True)
                        _release_memory(device)
                        if micro == 1:
                            break
                        micro //= 2  # same global batch, more accumulation: the loss curve is unchanged
                        set_rng_state(rng_at_start)  # the retried step draws the same dropout masks
                        accum = math.ceil(order.global_batch / micro)
                        run.event(
                            "retry", step=step, reason="out of memory", micro_batch=micro, grad_accum=accum
                        )
                        log.warning("out of memory at step %d: retrying with micro-batch %d", step, micro)
                if result is None:
                    status, reason = "failed", f"out of memory at step {step} even with a micro-batch of 1"
                    break
                loss_value, samples, tokens, data_wait = result
                stopping = stop.signal_name is not None
                over_budget = spec.cost.budget_usd is not None and cost_so_far() >= spec.cost.budget_usd
                if ranks.world > 1:  # one all-reduce: the step's figures, and decisions every rank shares
                    loss_value, samples, tokens, stops, overs = ranks.sum(
                        [loss_value, samples, tokens, float(stopping), float(over_budget)], device
                    )
                    samples, tokens, stopping, over_budget = int(samples), int(tokens), stops > 0, overs > 0
                if not math.isfinite(loss_value):
                    status, reason = "failed", f"loss is {loss_value} at step {step}"
                    break
                if scaler:
                    scaler.unscale_(optimizer)
                # the gradient norm (clipped or not) also guards the weights: a finite loss can still
                # give NaN/inf gradients, and one optimizer step on them would poison every checkpoint after
                grad_norm = torch.nn.utils.clip_grad_norm_(trained, spec.train.grad_clip or math.inf)
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the same on every rank
                    grad_norm = grad_norm.full_tensor()
                if not scaler and not math.isfinite(float(grad_norm)):
                    status, reason = "failed", f"gradient norm is {float(grad_norm)} at step {step}"
                    break
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                comm = parallel.pop_comm()
                comm_bytes_done += comm.get("comm_bytes", 0)

                step_time = time.perf_counter() - step_start
                clock.add(step_time)
                train_seconds += step_time
                samples_done, tokens_done = samples_done + samples, tokens_done + tokens

                # --- evaluate, log, checkpoint ---
                evaluation = None
                is_last = step == total_steps
                if data.eval is not None and (
                    is_last or (spec.train.eval_every and step % spec.train.eval_every == 0)
                ):
                    evaluation = last_eval = evaluate(
                        built, task, data.eval, micro, precision, device, eval_shards
                    )
                    module.train()
                if step % spec.train.log_every == 0 or evaluation or is_last:
                    record = {
                        "step": step,
                        "loss": loss_value,
                        "lr": lr,
                        "samples_per_s": samples / step_time,
                        "tokens_per_s": tokens / step_time if tokens else None,
                        "step_time_s": step_time,
                        "data_wait_frac": data_wait / step_time,
                        "peak_mem_bytes": peak_memory_bytes(device),
                        "mfu": flops.step_flops(samples, tokens) / step_time / (device_peak * ranks.world),
                        "cost_usd": cost_so_far(),
                        "step_cost_usd": usd(step_time, rate),
                        "eta_s": clock.eta(total_steps - step),
                        **comm,
                    }
                    if evaluation:
                        record.update({f"eval_{k}": v for k, v in evaluation.items()})
                    run.metric(record)
                    reporter.step(record)
                if spec.train.checkpoint_every and step % spec.train.checkpoint_every == 0 and not is_last:
                    checkpoint(step)
                if ranks.world == 1:  # one process: a signal that came during the optimizer step counts now
                    stopping = stop.signal_name is not None
                if stopping:
                    by = stop.signal_name or "a signal to another process of the job"
                    status, reason = "cancelled", f"stopped by {by} at step {step}"
                    break
                if ranks.world == 1:  # one process: the budget as of now, not as of the step's all-reduce
                    over_budget = spec.cost.budget_usd is not None and cost_so_far() >= spec.cost.budget_usd
                if over_budget and not is_last:
                    status = "paused"  # resumable: the same run directory with a higher budget goes on
                    spent = cost_so_far()
                    reason = f"cost.budget_usd {spec.cost.budget_usd:g} spent (${spent:.4f}) at step {step}"
                    break

        # --- the end: checkpoint what is good, write the model and the summary ---
        done_step = step if status != "failed" else step - 1
        if status != "failed" and done_step > start_step:
            checkpoint(done_step)
        finished_all = status == "finished" and done_step == total_steps
        # FSDP: every rank hands rank 0 its shards of the final weights
        gathered = parallel.full_states(optimizer) if finished_all else None
        gathered = gathered[0] if gathered else None
        if finished_all and ranks.is_main:
            save_artifact(
                run.model_dir,
                built,
                tokenizer,
                spec,
                data.labels,
                {"step": done_step, "precision": precision.name, "sample_shape": data.sample_shape},
                state_dict=gathered,
            )
        summary = {
            "status": status,
            "reason": reason,
            "steps": done_step,
            "total_steps": total_steps,
            "resumed_from": resumed_from,
            "samples_per_s": samples_done / train_seconds if train_seconds else None,
            "tokens_per_s": tokens_done / train_seconds if train_seconds and tokens_done else None,
            "median_step_s": clock.median(),
            "peak_mem_bytes": peak_memory_bytes(device),
            "final_loss": loss_value if status != "failed" else None,
            "eval": last_eval,
            "device": device_name(device),
            "device_type": device.type,
            "precision": precision.name,
            "precision_reason": precision.reason,
            "batch_size": micro,
            "grad_accum": math.ceil(math.ceil(order.global_batch / ranks.world) / micro),
            "global_batch_size": order.global_batch,
            "batch_search": search.as_dict() if search else None,
            "parameters": built.num_parameters,
            "trainable_parameters": built.num_trainable_parameters,
            "optimizer_state_bytes": optimizer_state_bytes(optimizer),
            "process_state_bytes": parallel.held_bytes(optimizer),  # what one process holds (FSDP: shards)
            "adapter": (
                "qlora-" + built.extra["quantize_base"] if built.extra.get("quantize_base") else "lora"
            )
            if built.adapter
            else None,
            "weight_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "flops_method": flops.method,
            "device_peak_flops": device_peak,
            "mfu": (
                flops.step_flops(samples_done, tokens_done) / train_seconds / (device_peak * ranks.world)
                if train_seconds
                else None
            ),
            "cost_usd": cost_so_far(),
            "usd_per_hour": rate,
            "launch_attempt": os.environ.get("GPUFORGE_ATTEMPT") if ranks.launched else None,
            "processes": ranks.world,
            "strategy": parallel.strategy,
            "gradient_compression": spec.distributed.gradient_compression
            if parallel.strategy == "ddp"
            else None,
            "comm_bytes_per_step": comm_bytes_done / (done_step - start_step) if comm_bytes_done else None,
            "wall_s": time.perf_counter() - process_start,
        }
        run.write_summary(summary)
        if status == "failed":
            good = run.latest_checkpoint()
            kept = f"; the last good checkpoint is {good[1].name}" if good else "; no checkpoint was written"
            run.event("failed", step=step, reason=reason + kept)
            log.error("%s%s", reason, kept)
            raise TrainingFailed(f"{reason}{kept} (run directory {run.root})")
        paused = {"cost_usd": cost_so_far(), "budget_usd": spec.cost.budget_usd} if status == "paused" else {}
        run.event(status, step=done_step, reason=reason, **paused)
        log.info("%s at step %d/%d%s", status, done_step, total_steps, f" ({reason})" if reason else "")
    summary["signal"] = stop.signal_number
    return summary


def forward_backward(
    built,
    task: str,
    data,
    indices: list[int],
    micro: int,
    precision,
    device,
    scaler,
    parallel: Parallel | None = None,
    global_size: int | None = None,
):
    """Gradients of the mean loss over the step's global batch, of which `indices` is this process's share
    (all of it with one process), summed over micro-batches of at most `micro` examples.

    Each micro-batch's mean loss is weighted by its share of the global batch of `global_size`, so the
    gradient is the same whatever the micro-batch size and the number of processes (DDP and FSDP average
    over processes: the weight is scaled up by their number to undo it). Gradients are synchronised across
    processes only after the last micro-batch. Returns (this share's part of the mean loss, samples,
    tokens, seconds spent fetching data)."""
    global_size = global_size or len(indices)
    parallel = parallel if parallel is not None and parallel.strategy != "none" else None
    world = parallel.ranks.world if parallel is not None else 1
    module = parallel.forward_module if parallel is not None else None
    loss_total = torch.zeros((), device=device)
    samples = tokens = 0
    data_wait = 0.0
    chunks = micro_batches(indices, micro)
    for i, chunk in enumerate(chunks):
        fetch_start = time.perf_counter()
        batch = to_device(data.collate(chunk), device)
        data_wait += time.perf_counter() - fetch_start
        with parallel.accumulating(last=i == len(chunks) - 1) if parallel else nullcontext():
            with autocast(precision, device):
                logits = tasks.forward(built, task, batch, module)
            loss_sum, terms = tasks.loss_sum_and_count(task, logits, batch)
            loss = loss_sum / terms * (len(chunk) / global_size)
            scaled = loss * world if world > 1 else loss
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_total += loss.detach()
        n_samples, n_tokens = tasks.count(task, batch)
        samples, tokens = samples + n_samples, tokens + n_tokens
    return float(loss_total), samples, tokens, data_wait  # float(): the one host sync per step, our NaN guard


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    """AdamW; no weight decay on biases and norm weights (1-D tensors), as careful users set it up."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused AdamW: one kernel over all tensors; on a CPU it makes the optimizer step ~5x faster
    return torch.optim.AdamW(groups, lr=lr, fused=device.type in ("cuda", "cpu"))


def check_same_job(run: RunDir, spec: JobSpec) -> None:
    """Resuming is only for the same job: refuse a run directory that holds another spec."""
    if not run.spec_path.exists():
        return
    stored = yaml.safe_load(run.spec_path.read_text()) or {}
    current = spec.model_dump(mode="json")
    differing = [key for key in _diff_keys(stored, current) if key not in RESUMABLE_CHANGES]
    if differing:
        names = ", ".join(".".join(k) for k in differing[:5])
        raise RunDirError(
            f"--out {run.root}: holds a run of a different spec (differs in {names}); "
            "use another --out to start a new run"
        )


def _diff_keys(a: Any, b: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            k for key in sorted(set(a) | set(b)) for k in _diff_keys(a.get(key), b.get(key), prefix + (key,))
        ]
    return [] if a == b else [prefix]


@contextmanager
def _stopping(reporter: Reporter):
    try:
        yield
    finally:
        reporter.stop()


@contextmanager
def _running(run: RunDir, spec: JobSpec, stop: StopFlag, ranks: Ranks):
    """From the first write to the last: signals only set the stop flag, the log goes to logs/train.log
    (logs/train-rank<N>.log for the other processes of a distributed job), and an unexpected error or
    interrupt becomes a failed/cancelled event."""
    with stop.installed():
        run.create()
        if ranks.is_main:
            run.spec_path.write_text(spec.to_yaml())
        log_name = "train.log" if ranks.is_main else f"train-rank{ranks.rank}.log"
        with _log_to(run.logs_dir / log_name, run, event_on_error=not ranks.launched):
            yield


@contextmanager
def _log_to(path: Path, run: RunDir, event_on_error: bool = True):
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpuforge")
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    try:
        yield
    except TrainingFailed:
        raise
    except KeyboardInterrupt:
        run.event("cancelled", reason="interrupted (second SIGINT), no checkpoint written")
        raise
    except Exception as err:
        log.exception("training stopped by an error")
        if event_on_error:  # a launched rank's launcher writes `restarted` or `failed`, with the reason
            run.event("failed", reason=f"{type(err).__name__}: {err}")
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


class StopFlag:
    """SIGTERM/SIGINT set a flag the loop checks after each step; a second SIGINT interrupts at once."""

    def __init__(self):
        self.signal_number: int | None = None

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signal_number).name if self.signal_number else None

    def _handle(self, signum, frame):
        if self.signal_number == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = signum

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; a thread-run job is stopped by its owner
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
