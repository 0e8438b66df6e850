"""The client a script job uses to report to gpuforge: standard library only, so a TensorFlow or JAX script
(or one in another virtual environment, with only gpuforge's package on its path) can import it cheaply.

    from gpuforge import track

    track.total_steps(steps)                      # optional: what progress and the ETA count against
    start = track.resume_step()                   # 0, or the step after the last checkpoint you marked
    for step in range(start, steps):
        ...
        track.log(step, loss=loss, accuracy=acc)  # a line of the run's metrics.jsonl
        if step % 100 == 0 or track.should_stop():
            save(track.checkpoint_dir() / "last")  # kept across restarts
            track.checkpointed(step)
        if track.should_stop():                   # cancelled, over budget, preempted: save and exit
            break

Outside a gpuforge run (no $GPUFORGE_RUN_DIR) every call does nothing useful but harmlessly: log() prints
nothing and writes nothing, checkpoint_dir() is a temporary folder, should_stop() is False; the same script
runs by hand.
"""

from __future__ import annotations

import json
import math
import operator
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

RUN_DIR_VARIABLE = "GPUFORGE_RUN_DIR"
JOB_ID_VARIABLE = "GPUFORGE_JOB_ID"  # the server's id of the job, where a server started it
TOTAL_STEPS_EVENT = "total_steps"  # the events line total_steps() writes (store/ingest.py reads it)
STOP_FILE = "stop"  # the runner writes it before SIGTERM: a script that never imported track sees it too
CHECKPOINT_EVENT = "checkpoint"  # the run directory's own event (runs.py), as the engine writes it

_stop = threading.Event()
_handler_installed = False
_lock = threading.Lock()
_private: Path | None = None


def run_dir() -> Path | None:
    """The run directory gpuforge gave this process, or None when run by hand."""
    value = os.environ.get(RUN_DIR_VARIABLE)
    return Path(value) if value else None


def _writer_run_dir() -> Path | None:
    """The run directory for what one process writes for the job: rank 0's alone under torchrun."""
    return run_dir() if os.environ.get("RANK", "0") == "0" else None


def log(step: int, **metrics: float) -> None:
    """One line of metrics for `step`: numbers only (a NaN or infinity is written as null). Under torchrun
    only rank 0 writes: the ranks' figures are one job's."""
    _listen_for_stop()
    where = _writer_run_dir()
    if where is None:
        return
    try:
        step = operator.index(step)  # an int, numpy's or a framework's integer scalar too
    except TypeError:
        raise ValueError(f"track.log: step must be a non-negative int, got {step!r}") from None
    if step < 0 or isinstance(step, bool):
        raise ValueError(f"track.log: step must be a non-negative int, got {step!r}")
    record: dict[str, float | int | None] = {"ts": time.time(), "step": step}
    for name, value in metrics.items():
        number = float(value)  # a tensor's or numpy scalar's value; a string is an error here
        record[name] = number if math.isfinite(number) else None
    _append(where / "metrics.jsonl", record)


def job_id() -> int | None:
    """The server's id of this job (what `gpuforge job ID` takes), or None when no server started it."""
    value = os.environ.get(JOB_ID_VARIABLE, "")
    return int(value) if value.isdigit() else None


def total_steps(steps: int) -> None:
    """Say how many steps the job has (its last step is steps - 1): the server shows `step 12/40` and the
    summary counts against it. Once is enough; a later call replaces it (a resume that changed its plan)."""
    try:
        steps = operator.index(steps)
    except TypeError:
        raise ValueError(f"track.total_steps: a positive int expected, got {steps!r}") from None
    if steps < 1 or isinstance(steps, bool):
        raise ValueError(f"track.total_steps: a positive int expected, got {steps!r}")
    where = _writer_run_dir()
    if where is not None:
        _append(where / "events.jsonl", {"ts": time.time(), "event": TOTAL_STEPS_EVENT, "total_steps": steps})


def declared_total_steps(run: Path) -> int | None:
    """The last total_steps() the script in run directory `run` declared, or None."""
    found = None
    for event in _events(run):
        if event.get("event") == TOTAL_STEPS_EVENT and isinstance(event.get("total_steps"), int):
            found = event["total_steps"]
    return found


def checkpoint_dir() -> Path:
    """A folder for the script's checkpoints, inside the run directory and kept when the job restarts."""
    _listen_for_stop()
    where = run_dir()
    if where is None:  # run by hand: a folder of this process's own, never one another user made
        global _private
        _private = _private or Path(tempfile.mkdtemp(prefix="gpuforge-script-"))
        return _private
    folder = where / "checkpoints" / "script"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def checkpointed(step: int) -> None:
    """Say that checkpoint_dir() now holds `step`: a restart resumes from it (resume_step() = step + 1)."""
    where = _writer_run_dir()
    if where is not None:
        record = {"ts": time.time(), "event": CHECKPOINT_EVENT, "step": operator.index(step), "by": "script"}
        _append(where / "events.jsonl", record)


def resume_step(run: Path | None = None) -> int:
    """The step to start from: one after the last checkpointed() of an earlier attempt, else 0 (of this
    process's run directory, or of `run`: the runner asks it for the attempt it starts)."""
    where = run or run_dir()
    if where is None:
        return 0
    last = -1
    for event in _events(where):
        if event.get("event") == CHECKPOINT_EVENT:
            last = max(last, int(event.get("step", -1)))
    return last + 1


def _events(run: Path) -> list[dict]:
    """The run's events.jsonl, its readable lines (a line cut by a kill is left out)."""
    found = []
    try:
        with open(run / "events.jsonl") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    found.append(event)
    except OSError:
        return []
    return found


def should_stop() -> bool:
    """True once gpuforge asked the job to stop (cancel, budget, preemption): save and exit soon, before the
    grace period (script.stop_grace_s) ends in SIGKILL."""
    _listen_for_stop()
    where = run_dir()
    return _stop.is_set() or (where is not None and (where / STOP_FILE).exists())


def _listen_for_stop() -> None:
    """From the first call on, SIGTERM sets the stop flag instead of killing the process at once, so the
    loop can save; a handler the script installed itself is left in place."""
    global _handler_installed
    with _lock:
        if _handler_installed or threading.current_thread() is not threading.main_thread():
            return
        _handler_installed = True
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
            # a worker forked from here (a data loader's) dies on SIGTERM as before, not saving anything
            os.register_at_fork(after_in_child=_forget_in_child)


def _on_sigterm(signum, frame) -> None:
    _stop.set()


def _forget_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _append(path: Path, record: dict) -> None:
    line = json.dumps(record, allow_nan=False) + "\n"
    with _lock, open(path, "a") as f:  # one write a line: a reader never sees half of one
        f.write(line)


def _run_as_rank(argv: list[str]) -> None:
    """`python -m gpuforge.track SCRIPT [ARGS...]`: what the runner has torchrun start for each rank. It
    runs SCRIPT as `python SCRIPT ARGS` would, in this process, after asking Linux to kill it when its
    parent (torchrun) dies: torchrun starts each rank in a session of its own, so nothing else would end a
    rank whose torchrun was killed."""
    import runpy
    import sys

    if not argv:
        sys.exit("usage: python -m gpuforge.track SCRIPT [ARGS...]")
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the runner's stop signals alone
    else:
        # torchrun may have died before the request took hold (this process was its child a moment ago):
        # the parent now is init or a subreaper, not torchrun
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = f.read()
        except OSError:
            parent = b""
        if b"torch.distributed.run" not in parent and b"torchrun" not in parent:
            sys.exit("gpuforge.track: torchrun, which started this rank, is gone")
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it
    runpy.run_path(os.path.abspath(script), run_name="__main__")  # __file__ absolute, as `python SCRIPT`


if __name__ == "__main__":
    import sys

    _run_as_rank(sys.argv[1:])
