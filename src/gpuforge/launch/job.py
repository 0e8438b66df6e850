"""Run one job as several processes: on this machine through torchrun's elastic launcher, on a Ray
cluster as actors (`gpuforge server --executor ray`), or as a Slurm job (GPUFORGE_EXECUTOR=slurm): which
one, the executor the runner builds from its environment says (gpuforge/executors/, `launch_ranks`).

    gpuforge train spec.yaml --out runs/x        # with distributed.strategy ddp|fsdp, resources.devices N

The `gpuforge train` process becomes the launcher: it starts N ranks (`python -m gpuforge.train.rank`),
one a device, and waits. A rank that dies (killed, a collective that timed out, a lost peer) makes the
others stop; the launcher then writes a `restarted` event and starts them all again, and they resume from
the newest checkpoint, up to `distributed.max_restarts` times. We count restarts ourselves (the elastic
agent's own max_restarts is 0) because an end the job chose (paused by its budget, a NaN loss, cancelled)
also exits non-zero and must not be retried: rank 0's summary, written in this attempt, tells them apart
from a crash. A SIGTERM to the launcher reaches every rank; they checkpoint at the same step and exit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge.child_env import passed
from gpuforge.errors import GpuforgeError, TrainingFailed
from gpuforge.runs import RunDir
from gpuforge.runtime.device_share import memory_cap, over_cap_words
from gpuforge.runtime.host import usable_cores
from gpuforge.settings import PREFIX, as_environment, current, env_name
from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.launch")

# A rank told to stop has this long to checkpoint before SIGKILL: less than the server's own grace for the
# launcher (executor.CANCEL_GRACE_S), so that the launcher is never killed before its ranks.
SHUTDOWN_GRACE_S = 20
# Rank exit codes that a restart would only repeat: bad input (2), out of memory (rank.EXIT_OUT_OF_MEMORY).
NOT_RETRIED = {
    2: "refused the job (bad input)",
    4: "ran out of memory (lower train.batch_size, or add devices)",
}
# What ranks on other machines need of the server's environment (Ray starts them from the raylet's own),
# less anything child_env.py would not pass (a token, a key).
FORWARDED_ENV = (
    PREFIX,  # every gpuforge setting
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "NCCL_",
    "GLOO_",
    "PYTHONPATH",
    "CUBLAS_",
)


@dataclass
class Attempt:
    failure: str | None = None  # how the attempt ended badly, when a rank did: "rank 1 was killed by SIGKILL"
    signal: int | None = None  # the launcher was told to stop by this signal
    final: bool = False  # the failure would happen again: no restart
    launched_as: str | None = (
        None  # the attempt id its ranks carry, where not this attempt's (Slurm's, followed)
    )


def check_devices(spec: JobSpec) -> str:
    """The device type the ranks will use; an error naming what exists when there are too few."""
    import torch

    wanted, kind = spec.resources.processes, spec.resources.device_type
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "cuda" or (kind == "auto" and gpus):
        if wanted > gpus:
            raise GpuforgeError(f"resources.devices: {wanted} GPUs asked for; this machine has {gpus}")
        return "cuda"
    cores = usable_cores()
    if wanted > cores:
        raise GpuforgeError(
            f"resources.devices: {wanted} CPU processes asked for; this machine has {cores} cores "
            "(a process a core at least)"
        )
    return "cpu"


def launch_local(spec: JobSpec, out: str | Path) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    device_type = check_devices(spec)
    nproc = spec.resources.processes
    if device_type == "cpu":  # the cores this job holds, shared out: N processes must not each take all
        held = int(os.environ.get("OMP_NUM_THREADS") or usable_cores())
        os.environ["OMP_NUM_THREADS"] = str(max(1, held // nproc))

    def attempt(number: int, argv: list[str], env: dict[str, str]) -> Attempt:
        os.environ.update(env)  # the ranks inherit the agent's environment
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port, as torchrun --standalone
            max_restarts=0,  # ours, in supervise(): a chosen end must not be retried
            monitor_interval=0.2,
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            elastic_launch(config, entrypoint=argv[0])(*argv[1:])
        except ChildFailedError as err:
            rank, failure = _first_failure(err.failures)
            message = failure.message if isinstance(failure.message, str) else ""
            return _failed(rank, failure.exitcode, message)
        except SignalException as err:
            return Attempt(signal=int(err.sigval))
        finally:  # the agent leaves its own handlers behind (they raise SignalException)
            for s, h in handlers.items():
                signal.signal(s, h)
        return Attempt()

    return supervise(spec, out, attempt)


def launch_ray(spec: JobSpec, out: str | Path, address: str) -> dict[str, Any]:
    """The ranks as actors on a Ray cluster: a GPU or a CPU each, the rendezvous on rank 0's node, their
    output streamed back into <run>/logs/rank<N>.log. The run directory must be on a filesystem every node
    sees (rank 0 writes it where it runs). With `resources.placement`, only on nodes with those labels."""
    from gpuforge.launch.ray_cluster import cluster_nodes, connect
    from gpuforge.launch.ray_placement import matching_nodes
    from gpuforge.launch.ray_ranks import run_ranks

    connect(address)
    placement = dict(spec.resources.placement)
    gpus = sum(n["gpus"] for n in matching_nodes(cluster_nodes(), placement))
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV) and passed(k)}
    on_gpu = spec.resources.device_type == "cuda" or (spec.resources.device_type == "auto" and gpus > 0)

    def attempt(number: int, argv: list[str], env: dict[str, str]) -> Attempt:
        with _stop_on_signals() as (stop, stopped_by):
            result = run_ranks(
                ["python", *argv[1:]],  # each node's own Python (the actor's), not this machine's path
                spec.resources.processes,
                Path(out),
                env={**forwarded, **env, "OMP_NUM_THREADS": "1"},
                gpus_per_rank=1 if on_gpu else 0,
                cpus_per_rank=0 if on_gpu else 1,  # a GPU rank takes no CPU slot: CPU jobs hold those
                stop=stop,
                grace_s=SHUTDOWN_GRACE_S,
                strategy="SPREAD",
                placement=placement or None,
            )
        nodes = sorted(set(result.node_ids))
        log.info(
            "%d ranks ran on %d nodes (%s)",
            len(result.exit_codes),
            len(nodes),
            ", ".join(
                f"{ip} node {node}" for ip, node in zip(result.node_ips, result.node_ids, strict=False)
            ),
        )
        if stopped_by:
            return Attempt(signal=stopped_by[0])
        if result.ok:
            return Attempt()
        rank = result.failed_rank if result.failed_rank is not None else 0
        return _failed(rank, result.exit_codes[rank], "", result.node_ips[rank : rank + 1])

    return supervise(spec, out, attempt)


def launch_slurm(spec: JobSpec, out: str | Path) -> dict[str, Any]:
    """The ranks as one Slurm job (launch/slurm.py): submitted by sbatch, its state followed, SIGTERM or
    SIGINT here passed to its ranks; a job an earlier launcher of this run submitted is followed, not
    submitted again. The run directory must be on a filesystem the nodes share."""
    from gpuforge.launch import slurm

    told, run = current(), RunDir(out)
    held = int(os.environ.get("OMP_NUM_THREADS") or usable_cores())  # the cores this job was given
    options = {
        "partition": told.slurm_partition,
        "account": told.slurm_account,
        "qos": told.slurm_qos,
        "cpus_per_task": str(max(1, held // spec.resources.processes)),
    }
    slurm.check_slurm(options)
    gpus = slurm.on_gpus(spec, told.slurm_partition)

    marks = slurm.RunningMarks(run)  # across attempts: a restart's wait in Slurm's queue is not charged

    def attempt(number: int, argv: list[str], env: dict[str, str]) -> Attempt:
        with _stop_on_signals() as (stop, stopped_by):
            earlier = slurm.earlier_job(run) if number == 0 else None
            if earlier is None:
                script = run.slurm_script_path(number)
                script.write_text(slurm.batch_script(spec, run, argv, options, gpus))
                sent = slurm.job_environment({**os.environ, **env})
                job_id, launched_as = slurm.submit(script, sent), None
                slurm.record(run, job_id, env[env_name("attempt")])
                log.info("submitted Slurm job %s (%s)", job_id, script)
            else:
                job_id, launched_as, _ = earlier
                log.info("following Slurm job %s, which an earlier launcher of this run submitted", job_id)
            fields = slurm.follow(job_id, stop, on_running=marks)
            marks(False)  # it ended: nothing runs until the next attempt's job does
            slurm.forget(run)  # its end is seen: a later launcher of this run (a resume) submits anew
        if stopped_by:
            return Attempt(signal=stopped_by[0], launched_as=launched_as)
        failure, final = slurm.outcome_of(job_id, fields)
        return Attempt(failure=failure, final=final, launched_as=launched_as)

    return supervise(spec, out, attempt)


def supervise(
    spec: JobSpec, out: str | Path, attempt: Callable[[int, list[str], dict[str, str]], Attempt]
) -> dict[str, Any]:
    """Run attempts until the ranks end as the job chose, restarting after a crash up to max_restarts."""
    from gpuforge.train.resume import check_same_job

    run = RunDir(out)
    run.check_usable()
    check_same_job(run, spec)  # before the launcher writes anything into another job's run directory
    run.logs_dir.mkdir(parents=True, exist_ok=True)
    # beside the logs (the one thing a launcher may add to a run directory): every node sees it
    spec_file = run.logs_dir / "launch-spec.yaml"
    spec_file.write_text(spec.to_yaml())  # paths in it are absolute already
    argv = [sys.executable, "-m", "gpuforge.train.rank", str(spec_file), "--out", str(run.root.resolve())]
    restarts = spec.distributed.max_restarts
    for number in range(restarts + 1):
        # rank 0 writes this id into summary.json: a summary with it was written by this attempt's ranks
        # (an mtime would mislead across machines whose clocks differ, on a shared filesystem)
        attempt_id = uuid.uuid4().hex
        outcome = attempt(number, argv, as_environment(restart=number, attempt=attempt_id))
        summary = run.read_summary()
        fresh = summary is not None and summary.launch_attempt == (outcome.launched_as or attempt_id)
        if outcome.signal is not None:
            if not fresh:
                name = signal.Signals(outcome.signal).name
                raise TrainingFailed(f"stopped by {name} before the ranks wrote a summary")
            return summary.as_result(outcome.signal)
        # ranks that checkpointed on a SIGTERM the launcher did not send (Slurm's time limit, a preemption
        # without requeue, someone's scancel): the end is the scheduler's failure, not a cancel asked for
        stopped_outside = fresh and summary.status == "cancelled" and outcome.failure is not None
        if (outcome.failure is None or fresh) and not stopped_outside:
            if summary is None:
                raise TrainingFailed(f"the ranks ended without a summary in {run.root}")
            if summary.status == "failed":
                raise TrainingFailed(f"{summary.reason} (run directory {run.root})")
            return summary.as_result(signal=None)
        if number < restarts and not outcome.final:
            log.warning(
                "%s; restart %d of %d from the last checkpoint", outcome.failure, number + 1, restarts
            )
            run.event("restarted", attempt=number + 1, max_restarts=restarts, reason=outcome.failure)
            continue
        reason = outcome.failure if outcome.final else f"{outcome.failure}; all {restarts} restarts used"
        run.event("failed", reason=reason)
        if outcome.final and "bad input" in reason:
            raise GpuforgeError(reason)
        raise TrainingFailed(f"{reason} (run directory {run.root})")
    raise AssertionError("unreachable")


def _first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure ended the attempt, of torch's ProcessFailures by rank. Not torch's
    get_first_failure (the smallest timestamp) alone: timestamps are whole seconds, and a rank that raised
    because its peer died dates its error file before the polling agent dates that peer's death, which
    blamed the survivor. So a rank killed outright (SIGKILL, SIGSEGV: not what a peer's failure does to a
    rank) goes first, then any other failure, then the ranks the agent stopped itself (SIGTERM, or 128+15
    once a rank caught it); within each, the smallest timestamp, as torch."""

    def order(item: tuple[int, Any]) -> tuple[int, int]:
        code = item[1].exitcode
        stopped_by_agent = code in (-signal.SIGTERM, 128 + signal.SIGTERM)
        return (2 if stopped_by_agent else 0 if code < 0 else 1), item[1].timestamp

    return min(failures.items(), key=order)


def _failed(rank: int, code: int | None, message: str = "", where: list[str] = ()) -> Attempt:
    """How rank `rank` ended, in words, and whether restarting would help."""
    if code is None:
        how = "was lost (its actor or node went away)"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = NOT_RETRIED.get(code, f"exited with code {code}")
        if code == 4 and (capped := memory_cap()) is not None:  # out of memory under its fraction's cap
            how = f"ran out of memory: over {over_cap_words(capped)} (ask for a larger fraction)"
    on = f" on {where[0]}" if where else ""
    # torch's placeholders when the rank left no message: not worth repeating
    useful = message and "<N/A>" not in message and "To enable traceback" not in message
    detail = f": {message.splitlines()[0][:300]}" if useful else ""
    return Attempt(failure=f"rank {rank}{on} {how}{detail}", final=code in NOT_RETRIED)


@contextmanager
def _stop_on_signals():
    """(an Event that SIGTERM or SIGINT sets, the signals that came) while the ranks run elsewhere."""
    stop, stopped_by = threading.Event(), []

    def handle(signum, frame):
        stopped_by.append(signum)
        stop.set()

    with _handlers(handle):
        yield stop, stopped_by


@contextmanager
def _handlers(handler):
    """SIGTERM and SIGINT call `handler` while the ranks run (main thread only: signals arrive there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
