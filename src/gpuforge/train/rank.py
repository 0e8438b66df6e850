"""One process of a distributed job, started by a launcher (launch/job.py, ray_launch.py):

    python -m gpuforge.train.rank SPEC.yaml --out RUN_DIR      # with RANK, WORLD_SIZE, MASTER_ADDR... set

Exit codes as `gpuforge train`: 0 finished, 1 failed, 2 bad input, 3 paused by the budget, 128+N stopped
by signal N (after the checkpoint every rank writes its part of), and 4 out of memory (the launcher does
not restart a job for it: the same step would run out again).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from gpuforge import quiet
from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import GpuforgeError, TrainingFailed
from gpuforge.runs import RunResult
from gpuforge.spec import load_spec
from gpuforge.train.signals import hold_until_the_loop

EXIT_OUT_OF_MEMORY = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuforge.train.rank")
    parser.add_argument("spec")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not quiet.verbose():  # as `gpuforge` itself: before torch's and transformers' heavy imports below
        quiet.quiet_third_party()
    hold_until_the_loop()  # before the launcher's death can send one: set-up is never cut short
    _stop_with_launcher()
    ranks = Ranks.from_env()
    handler = logging.StreamHandler()  # gpuforge's own lines, tagged: the ranks share one stderr
    handler.setFormatter(logging.Formatter(f"[rank {ranks.rank}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("gpuforge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    from gpuforge.hardware.probe import is_out_of_memory
    from gpuforge.train.engine import train

    try:
        result = RunResult.model_validate(train(load_spec(args.spec), args.out))
        ranks.barrier()  # all past their last collective before any tears its connections down
    except TrainingFailed as err:
        _tell_launcher(err)
        print(f"[rank {ranks.rank}] training failed: {err}", file=sys.stderr)
        return 1
    except GpuforgeError as err:
        _tell_launcher(err)
        print(f"[rank {ranks.rank}] error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        _tell_launcher(err)
        if is_out_of_memory(err):
            print(f"[rank {ranks.rank}] out of memory: {err}", file=sys.stderr)
            return EXIT_OUT_OF_MEMORY
        raise
    finally:
        ranks.stop()
    if result.signal:
        return 128 + result.signal
    return 3 if result.status == "paused" else 0


def _stop_with_launcher() -> None:
    """A SIGTERM when the launcher dies (even by SIGKILL): the rank checkpoints and stops instead of
    training on, untracked, into a run directory a resumed job may write too. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before the line above
        sys.exit(128 + signal.SIGTERM)


def _tell_launcher(err: BaseException) -> None:
    """The error's one line, for the launcher's events (torchrun's agent reads it from this file)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

        ErrorHandler().record_exception(err)


if __name__ == "__main__":
    sys.exit(main())
