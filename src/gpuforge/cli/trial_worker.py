"""One process that runs a local search's trials one after another, so that each trial does not pay the
interpreter's start and the imports again (torch, transformers, PEFT: seconds, more than a short trial's
steps). Started by search/trials.py, never by hand:

    python -m gpuforge.cli.trial_worker RESULTS_FD TRIALS_DIR

It reads one order per line on stdin, `{"number": 3, "spec": ".../trial-0003.yaml", "out": ".../trial-0003",
"log": ".../trial-0003.log"}`, runs the trial exactly as `gpuforge train SPEC --out DIR` does (the same
function: policy, executor, resume from a checkpoint), its output going to the trial's log, and writes one
line to RESULTS_FD when it ends: `{"number": 3, "code": 0}` (code 1 and `error` when it raised).

Stopping: SIGTERM stops the trial at a checkpoint, as it stops `gpuforge train` (the worker then waits for
its next order, or the end of stdin); SIGUSR1 prunes it at once (no checkpoint: a pruned trial is not
resumed), `{"number": 3, "code": 0, "pruned": true}`. Between trials both are harmless. TRIALS_DIR is on the
command line so that a driver that restarts can tell this worker (still saving a checkpoint) by its pid.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any


class TrialPruned(BaseException):
    """Raised in the trial by SIGUSR1: a BaseException, so that no `except Exception` on the way (ours or a
    library's) takes it for an error of the trial's own."""


class Worker:
    def __init__(self, results_fd: int):
        self.results = os.fdopen(results_fd, "w", buffering=1)
        self.in_trial = False
        signal.signal(signal.SIGUSR1, self._on_prune)

    def _on_prune(self, signum, frame) -> None:
        if self.in_trial:  # once: a second SIGUSR1 while the first unwinds is not raised again
            self.in_trial = False
            raise TrialPruned

    def serve(self) -> None:
        # the imports every trial needs, once, before the first order (the driver charges the first trial)
        import gpuforge.train.engine  # noqa: F401

        for line in sys.stdin:
            order = json.loads(line)
            answer = self.run_trial(order)
            try:
                self.results.write(json.dumps(answer) + "\n")
            except BrokenPipeError:
                return  # the driver is gone: the trial stopped at a checkpoint, the next driver resumes it

    def run_trial(self, order: dict[str, Any]) -> dict[str, Any]:
        from gpuforge.cli.local import _run_job

        number = order["number"]
        with open(order["log"], "ab", buffering=0) as log:
            _output_to(log.fileno())
            try:
                try:
                    self.in_trial = True
                    _run_job(Path(order["spec"]), Path(order["out"]), [], quiet=True)
                    self.in_trial = False  # a SIGUSR1 from here on finds the trial ended
                except TrialPruned:
                    return {"number": number, "code": 0, "pruned": True}
                finally:
                    self.in_trial = False
            except TrialPruned:  # arrived as the trial's own exception unwound: pruned all the same
                return {"number": number, "code": 0, "pruned": True}
            except BaseException as err:  # noqa: BLE001 - any end of the trial is reported; the worker goes on
                if isinstance(err, KeyboardInterrupt | SystemExit):
                    raise
                traceback.print_exc()
                return {"number": number, "code": 1, "error": f"{type(err).__name__}: {err}"[:1000]}
            finally:
                _output_to(os.open(os.devnull, os.O_WRONLY), close=True)
                gc.collect()  # the trial's model and data go before the next one's are built
        return {"number": number, "code": 0}


def _output_to(fd: int, close: bool = False) -> None:
    """This process's stdout and stderr (Python's and the libraries' C code alike) now go to `fd`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if close:
        os.close(fd)


def main(argv: list[str]) -> None:
    Worker(int(argv[1])).serve()


if __name__ == "__main__":
    main(sys.argv)
