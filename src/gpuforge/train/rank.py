"""One process of a distributed job, started by a launcher (distributed/launch.py, ray_launch.py):

    python -m gpuforge.train.rank SPEC.yaml --out RUN_DIR      # with RANK, WORLD_SIZE, MASTER_ADDR... set

Exit codes as `gpuforge train`: 0 finished, 1 failed, 2 bad input, 3 paused by the budget, 128+N stopped
by signal N (after the checkpoint every rank writes its part of).
"""

from __future__ import annotations

import argparse
import logging
import sys

from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import GpuforgeError, TrainingFailed
from gpuforge.spec import load_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuforge.train.rank")
    parser.add_argument("spec")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    ranks = Ranks.from_env()
    handler = logging.StreamHandler()  # gpuforge's own lines, tagged: the ranks share one stderr
    handler.setFormatter(logging.Formatter(f"[rank {ranks.rank}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("gpuforge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    from gpuforge.train.engine import train

    try:
        summary = train(load_spec(args.spec), args.out)
    except TrainingFailed as err:
        print(f"[rank {ranks.rank}] training failed: {err}", file=sys.stderr)
        return 1
    except GpuforgeError as err:
        print(f"[rank {ranks.rank}] error: {err}", file=sys.stderr)
        return 2
    finally:
        ranks.stop()
    if summary.get("signal"):
        return 128 + summary["signal"]
    return 3 if summary["status"] == "paused" else 0


if __name__ == "__main__":
    sys.exit(main())
