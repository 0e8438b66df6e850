"""The end of a run: its last checkpoint, the model (when every step is done), summary.json and the event
that says how it ended."""

from __future__ import annotations

import logging
import math
import time

from gpuforge.artifact import save_artifact
from gpuforge.errors import TrainingFailed
from gpuforge.hardware.probe import device_name, peak_memory_bytes
from gpuforge.runs import RunSummary
from gpuforge.runtime.memory import optimizer_state_bytes
from gpuforge.settings import current
from gpuforge.train.metrics import Meter
from gpuforge.train.trainer import LoopState, Trainer

log = logging.getLogger("gpuforge.train")


def finish(t: Trainer, state: LoopState, meter: Meter) -> RunSummary:
    """Checkpoint what is good, write the model and the summary, and record how the run ended. Raises
    TrainingFailed, after writing the summary, when the run failed."""
    run, done = t.run, state.done_step
    if state.status != "failed" and done > state.start_step:
        t.checkpoint(state, done)
    if state.status == "finished" and (done == t.job.total_steps or t.ended_early):
        _save_model(t, _keep_best(t, state) or done)
    summary = summarize(t, state, meter)
    run.write_summary(summary)
    if state.status == "failed":
        good = run.latest_checkpoint()
        kept = f"; the last good checkpoint is {good[1].name}" if good else "; no checkpoint was written"
        run.event("failed", step=state.step, reason=f"{state.reason}{kept}")
        log.error("%s%s", state.reason, kept)
        raise TrainingFailed(f"{state.reason}{kept} (run directory {run.root})")
    paused = state.status == "paused"
    spend = {"cost_usd": t.spent(state), "budget_usd": t.spec.cost.budget_usd} if paused else {}
    run.event(state.status, step=done, reason=state.reason, **spend)
    reason = f" ({state.reason})" if state.reason else ""
    log.info("%s at step %d/%d%s", state.status, done, t.job.total_steps, reason)
    return summary


def _keep_best(t: Trainer, state: LoopState) -> int | None:
    """train.keep_best: the best evaluation's weights become the model, and its figures the summary's eval
    (the last step's are in metrics.jsonl); the reason says which step's model it is. Its step, or None."""
    if not t.spec.train.keep_best:
        return None
    step = t.restore_best()
    watched = t.watch.state if t.watch is not None else None
    if step is None or watched is None:
        return None
    state.last_eval = {k.removeprefix("eval_"): v for k, v in (watched.best_figures or {}).items()}
    kept = f"model kept from step {step} (best {t.watch.metric} {watched.best:.4g})"
    state.reason = f"{state.reason}; {kept}" if state.reason else kept
    return step


def _save_model(t: Trainer, step: int) -> None:
    job = t.job
    gathered = t.parallel.full_states(t.optimizer)  # FSDP: every rank hands rank 0 its shards of the weights
    if t.ranks.is_main:
        save_artifact(
            t.run.model_dir,
            job.built,
            job.tokenizer,
            job.spec,
            job.data.labels,
            {"step": step, "precision": job.precision.name, "sample_shape": job.data.sample_shape},
            state_dict=gathered[0] if gathered else None,
        )


def summarize(t: Trainer, state: LoopState, meter: Meter) -> RunSummary:
    """The run's figures as summary.json holds them."""
    job, ranks, device, built, seconds = t.job, t.ranks, t.job.device, t.job.built, state.train_seconds
    ddp = t.parallel.strategy == "ddp"
    return RunSummary(
        status=state.status,
        reason=state.reason,
        steps=state.done_step,
        total_steps=job.total_steps,
        resumed_from=state.resumed_from,
        samples_per_s=state.samples_done / seconds if seconds else None,
        tokens_per_s=state.tokens_done / seconds if seconds and state.tokens_done else None,
        median_step_s=state.clock.median(),
        peak_mem_bytes=peak_memory_bytes(device),
        final_loss=state.loss if state.status != "failed" else None,
        eval=state.last_eval,
        device=device_name(device),
        device_type=device.type,
        precision=job.precision.name,
        precision_reason=job.precision.reason,
        batch_size=state.micro,
        grad_accum=math.ceil(math.ceil(job.order.global_batch / ranks.world) / state.micro),
        global_batch_size=job.order.global_batch,
        batch_search=job.search.as_dict() if job.search else None,
        parameters=built.num_parameters,
        trainable_parameters=built.num_trainable_parameters,
        optimizer_state_bytes=optimizer_state_bytes(t.optimizer),
        process_state_bytes=t.parallel.held_bytes(t.optimizer),  # what one process holds (FSDP: shards)
        adapter=_adapter(built) if built.adapter else None,
        weight_bytes=sum(p.numel() * p.element_size() for p in t.module.parameters()),
        flops_method=meter.flops.method,
        device_peak_flops=meter.device_peak,
        mfu=meter.mfu(state.samples_done, state.tokens_done, seconds) if seconds else None,
        cost_usd=t.spent(state),
        usd_per_hour=t.usd_per_hour,
        launch_attempt=current().attempt if ranks.launched else None,
        processes=ranks.world,
        strategy=t.parallel.strategy,
        gradient_compression=t.spec.distributed.gradient_compression if ddp else None,
        comm_bytes_per_step=(
            state.comm_bytes_done / (state.done_step - state.start_step) if state.comm_bytes_done else None
        ),
        wall_s=time.perf_counter() - t.started,
        energy_j=t.energy_j if t.energy_source else None,
        energy_source=t.energy_source,
    )


def _adapter(built) -> str:
    quantized = built.extra.get("quantize_base")
    return f"qlora-{quantized}" if quantized else "lora"
