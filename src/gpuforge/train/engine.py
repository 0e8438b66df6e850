"""The training loop. It reads top to bottom: set-up, resume, the steps, the end.

    gpuforge train examples/digits-cnn.yaml --out runs/digits

It writes only the run directory (runs.py): no server, no database. Signals (SIGTERM, SIGINT) make it
checkpoint and stop cleanly (SIGUSR1: stop at the step's end with no checkpoint, a search's pruned
trial); running it again on the same --out resumes from the newest checkpoint and continues the same loss
curve. The parts it strings together: setup.py (the job), trainer.py (the state and each step's work),
checkpoint.py, summary.py (the end), resume.py (which run directories it goes on with).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import SpecError, TrainingFailed
from gpuforge.hardware.probe import device_name
from gpuforge.profile_files import PROFILE_DIR
from gpuforge.runs import ReaderRunDir, RunDir
from gpuforge.runtime.phases import phase
from gpuforge.spec import JobSpec
from gpuforge.train.batch import check_memory_budget
from gpuforge.train.checkpoint import read_meta
from gpuforge.train.exports import NoTracking, make_tracker
from gpuforge.train.lr_find import MAX_LR, MIN_LR, find_lr
from gpuforge.train.lr_find import STEPS as LR_FIND_STEPS
from gpuforge.train.profile import Profiling, StepProfiler, step_profiler
from gpuforge.train.progress import Reporter
from gpuforge.train.resume import check_not_past, check_same_job, finished_already
from gpuforge.train.setup import build_job
from gpuforge.train.signals import StopFlag
from gpuforge.train.summary import finish
from gpuforge.train.trainer import LoopState, Trainer

__all__ = ["train"]

log = logging.getLogger("gpuforge.train")


def train(spec: JobSpec, out: str | Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run a job to its end (or a signal, NaN loss, budget) and return its summary, with `signal`: the
    number of the signal that stopped it, or None (a dict of runs.RunResult's fields)."""
    started = time.perf_counter()
    ranks = Ranks.from_env()  # world 1 unless launched as one of several processes (launch/job.py)
    _check_strategy(spec, ranks)
    run = RunDir(out) if ranks.is_main else ReaderRunDir(out)
    run.check_usable()
    check_same_job(run, spec)
    tracker = make_tracker(spec.tracking) if ranks.is_main else NoTracking()  # a missing package: stop now
    latest = run.latest_checkpoint()

    # --- device, precision, data, model, batch: everything that can fail on bad input, before any write ---
    resumed = read_meta(latest[1]) if latest else None
    job = build_job(spec, resumed or {}, ranks)
    check_memory_budget(job)  # resources.max_memory: refused here with `gpuforge plan`'s verdict
    check_not_past(run, latest[0] if latest else None, job.total_steps)

    # --- processes, optimizer, schedule, loss scaling; then the newest checkpoint, if there is one ---
    trainer = Trainer.build(job, ranks, run, reporter or Reporter(), started, resumed)
    state = trainer.resume(latest)
    finished = finished_already(run, state.resumed_from, job.total_steps, trainer.ended_early)
    if finished is not None:
        return finished.as_result(signal=None)
    run.truncate_metrics_after(state.start_step)  # steps logged past the checkpoint run again

    stop = StopFlag()
    with _running(run, spec, stop, ranks), tracker.opened(run, spec, state.resumed_from):
        _pick_lr(trainer, state)  # train.lr auto: the range test, before step 1 (not on resume)
        _announce(trainer, state)
        meter = trainer.start_meter(state.start_step)
        trainer.reporter.start(job.total_steps, state.start_step)
        steps = range(state.start_step + 1, job.total_steps + 1)
        profiler = _profiling(trainer, run, steps)
        with _stopping(trainer.reporter), _closing(profiler):
            for step in steps:
                asked = profiler.asked()  # a request file: steps to profile from the next one
                with profiler.step(step):  # a profile window's steps only; nothing at the others
                    result = trainer.step(state, step, stop, asked)  # forward/backward (less on OOM), update
                    if result is None:
                        profiler.note_failed()
                        break  # failed: state.reason says why
                    profiler.note_comm(result.comm)
                    with phase("evaluation"):
                        evaluation = trainer.evaluate_if_due(state)
                        # train.early_stop, stop_at, keep_best: only at an evaluation, only when asked for
                        ended = evaluation is not None and trainer.watch is not None
                        ended = ended and trainer.judge(state, evaluation)
                    with phase("logging"):
                        record = trainer.log_if_due(state, result, evaluation, meter)
                        tracker.metric(record)  # TensorBoard, MLflow: as the spec's tracking section asks
                    with phase("checkpoint"):
                        if not ended:  # an ended run's checkpoint is the end's
                            trainer.checkpoint_if_due(state)
                stop.check_dropped()  # SIGUSR1 (a pruned trial): no checkpoint, no summary
                if result.profile_steps:  # every process agreed on it in the step's all-reduce
                    profiler.open(step + 1, result.profile_steps, job.total_steps)
                if ended or trainer.should_stop(state, result, stop):  # early stop, a signal, the budget
                    break
        summary = finish(trainer, state, meter)  # the last checkpoint, the model, summary.json, the event
        tracker.finish(summary.as_dict(), run.model_dir)
    return summary.as_result(stop.signal_number)


def _profiling(t: Trainer, run: RunDir | ReaderRunDir, steps: range) -> Profiling:
    """train.profile's window, and the windows asked for while the run goes on (taken by rank 0 alone)."""
    context, folder, main = _profiled(t), run.root / PROFILE_DIR, t.ranks.is_main
    written = (lambda **figures: run.event("profiled", **figures)) if main else None

    def window(first: int, count: int) -> StepProfiler:
        return StepProfiler(first, count, folder, t.job.device, t.ranks.rank, context, written)

    spec_window = step_profiler(
        t.spec.train.profile, run.root, t.job.device, t.ranks.rank, context, steps, written
    )
    began = time.time() - (time.perf_counter() - t.started)  # this attempt's start, as a file's mtime reads
    return Profiling(spec_window, window, run.root if main else None, not_before=began)


def _profiled(t: Trainer) -> dict[str, Any]:
    """What a profile's advice needs to know of the run (which levers are pulled already)."""
    built = t.job.built
    return {
        "trainable_params": built.num_trainable_parameters,
        "params": built.num_parameters,
        "lora": bool(built.adapter),
        "compile": t.spec.train.compile,
        "strategy": t.parallel.strategy,
        "processes": t.ranks.world,
        "eval_every": t.spec.train.eval_every,
        "gradient_compression": t.spec.distributed.gradient_compression,
        "precision": t.job.precision.name,
        "global_batch": t.job.order.global_batch,
    }


@contextmanager
def _closing(profiler):
    """The profile's window closed however the loop ends (a run that ends, fails or raises inside it):
    what was recorded is written and torch.profiler stops."""
    try:
        yield
    finally:
        profiler.close()


def _check_strategy(spec: JobSpec, ranks: Ranks) -> None:
    if ranks.world > 1 and spec.distributed.strategy == "none":
        raise SpecError(
            f"launched as rank {ranks.rank} of {ranks.world} but distributed.strategy is none: every "
            "process would train its own copy into one run directory"
        )


def _pick_lr(t: Trainer, state: LoopState) -> None:
    """train.lr auto: a fresh run's range test picks the rate (lr_find.py); a resumed run's checkpoint
    holds the rate its test picked (the optimizer's and the schedule's state)."""
    if t.spec.train.lr != "auto" or state.resumed_from is not None:
        return
    log.info("lr auto: a range test of %d steps, lr %g to %g", LR_FIND_STEPS, MIN_LR, MAX_LR)
    test = find_lr(t)
    t.use_lr(test.lr)
    log.info("lr auto: %s; the test took %.1f s (%d steps)", test.reason, test.seconds, test.steps)
    if t.ranks.is_main:
        test.write(t.run)
        t.run.event("lr_found", lr=test.lr, reason=test.reason, steps=test.steps, seconds=test.seconds)


def _announce(t: Trainer, state: LoopState) -> None:
    """The log's account of the job, and the `started` event."""
    job, device, built, data, search = t.job, t.job.device, t.job.built, t.job.data, t.job.search
    log.info("job %s on %s (%s)", t.spec.name, device_name(device), device.type)
    log.info("precision %s: %s", job.precision.name, job.precision.reason)
    log.info("lr %g, schedule %s", t.scheduler.base_lrs[0], t.shape.why)
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
        job.order.global_batch,
        state.micro,
    )
    if state.resumed_from is not None:
        log.info("resuming from checkpoint step %d of %d", state.resumed_from, job.total_steps)
    if search is not None:
        log.info(
            "batch size auto: micro-batch %d (%.0f MiB per sample, %.2f of %.2f GiB budget: %s)",
            state.micro,
            search.per_sample_bytes / 2**20,
            search.predicted_bytes(state.micro) / 2**30,
            search.budget_bytes / 2**30,
            search.budget_source,
        )
    t.run.event(
        "started",
        step=state.start_step,
        total_steps=job.total_steps,
        device=device_name(device),
        precision=job.precision.name,
        lr=t.scheduler.base_lrs[0],  # train.lr auto: the range test's pick
        resumed_from=state.resumed_from,
        micro_batch=state.micro,
        global_batch=job.order.global_batch,
        batch_search=search.as_dict() if search else None,
        processes=t.ranks.world,
        strategy=t.parallel.strategy,
        restart=t.ranks.restart,
        setup_s=round(time.perf_counter() - t.started, 3),  # device, data, model, batch: before step 1
    )


@contextmanager
def _stopping(reporter: Reporter) -> Iterator[None]:
    try:
        yield
    finally:
        reporter.stop()


@contextmanager
def _running(run: RunDir, spec: JobSpec, stop: StopFlag, ranks: Ranks) -> Iterator[None]:
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
def _log_to(path: Path, run: RunDir, event_on_error: bool = True) -> Iterator[None]:
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
