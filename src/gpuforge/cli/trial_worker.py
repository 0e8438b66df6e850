"""One process that runs a local search's trials one after another, so that each trial does not pay the
interpreter's start and the imports again (torch, transformers, PEFT: seconds, more than a short trial's
steps). Started by search/trials.py, never by hand:

    python -m gpuforge.cli.trial_worker RESULTS_FD TRIALS_DIR

It reads one order per line on stdin, `{"number": 3, "spec": ".../trial-0003.yaml", "out": ".../trial-0003",
"log": ".../trial-0003.log"}`, runs the trial exactly as `gpuforge train SPEC --out DIR` does (the same
function: policy, executor, resume from a checkpoint), its output going to the trial's log, and writes one
line to RESULTS_FD when it ends: `{"number": 3, "code": 0}` (code 1 and `error` when it raised).

Stopping: SIGTERM stops the trial at a checkpoint, as it stops `gpuforge train` (the worker then waits for
its next order, or the end of stdin); between trials, or while a trial sets up, it ends the worker (a
trial with no step yet has nothing to save). SIGUSR1 drops the trial at the end of its step (no
checkpoint: a pruned trial is not resumed), `{"number": 3, "code": 0, "pruned": true}`; before its loop
starts, or between trials, it is ignored (the driver sends it again until the trial is dropped).
TRIALS_DIR is on the command line so that a driver that restarts can tell this worker (still saving a
checkpoint) by its pid.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any


class Worker:
    def __init__(self, results_fd: int):
        self.results = os.fdopen(results_fd, "w", buffering=1)
        # SIGUSR1 between trials (a prune that came late) is nothing; in a trial the loop's StopFlag
        # takes it and drops the run at the end of its step (train/signals.py)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        self.own_output = os.dup(1)  # the worker's own output (worker.log), between trials

    def serve(self) -> None:
        # the imports every trial needs, once, before the first order (the driver charges the first trial)
        import gpuforge.train.engine  # noqa: F401

        for line in sys.stdin:
            answer = self.run_trial(json.loads(line))
            try:
                self.results.write(json.dumps(answer) + "\n")
            except BrokenPipeError:
                return  # the driver is gone: the trial stopped at a checkpoint, the next driver resumes it

    def run_trial(self, order: dict[str, Any]) -> dict[str, Any]:
        from gpuforge.cli.local import _run_job
        from gpuforge.train.signals import RunDropped

        number = order["number"]
        with open(order["log"], "ab", buffering=0) as log:
            _output_to(log.fileno())
            try:
                _run_job(Path(order["spec"]), Path(order["out"]), [], quiet=True)
            except RunDropped:
                return {"number": number, "code": 0, "pruned": True}
            except Exception as err:  # noqa: BLE001 - the trial's end, whatever it is; the worker goes on
                traceback.print_exc()
                return {"number": number, "code": 1, "error": f"{type(err).__name__}: {err}"[:1000]}
            finally:
                _output_to(self.own_output)
                _release_memory()
        return {"number": number, "code": 0}


def _output_to(fd: int) -> None:
    """This process's stdout and stderr (Python's and the libraries' C code alike) now go to `fd`."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio's buffers, before their file changes under them
    except (OSError, AttributeError):
        pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def _release_memory() -> None:
    """The trial's model and data go before the next one's are built (and a GPU's cached blocks, which
    another slot's worker may need)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def main(argv: list[str]) -> None:
    from gpuforge.quiet import quiet_third_party, verbose

    worker = Worker(int(argv[1]))
    if not verbose():  # as `gpuforge train` does, before torch and the rest are imported
        quiet_third_party()
    worker.serve()


if __name__ == "__main__":
    main(sys.argv)
