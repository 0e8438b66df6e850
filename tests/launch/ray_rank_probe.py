"""One rank for tests/launch/test_ray_ranks.py (not collected by pytest).

python ray_rank_probe.py [--fail-rank R --exit-code N] [--wait] [--ignore-term RANK]

Reads torchrun's variables, joins a gloo process group through env://, all-reduces (rank + 1) and prints one
``probe`` line with rank, world, the sum, LOCAL_RANK, LOCAL_WORLD_SIZE, the host name and the IP. Then:
``--fail-rank R``: rank R exits with ``--exit-code`` and every other rank sleeps (it would hang, and must be
stopped); ``--wait``: every rank prints ``waiting`` and sleeps; ``--ignore-term R``: rank R ignores SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from gpuforge.distributed.ranks import leave_process_group


def _ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--exit-code", type=int, default=3)
    ap.add_argument("--wait", action="store_true")
    ap.add_argument("--ignore-term", type=int, default=None)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    if args.ignore_term == rank:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    peers_done = False
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        info = {
            "rank": rank,
            "world": dist.get_world_size(),
            "sum": t.item(),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
            "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            "hostname": socket.gethostname(),
            "ip": _ip(),
            "cwd": os.getcwd(),
        }
        print("probe " + json.dumps(info), flush=True)
        print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)
        if args.fail_rank is not None:
            if rank == args.fail_rank:
                print(f"rank {rank} fails with {args.exit_code}", flush=True)
                return args.exit_code  # its group still goes down (finally): the exit code stays its own
            time.sleep(600)
        if args.wait:
            print("waiting", flush=True)
            time.sleep(600)
        peers_done = True
    finally:
        leave_process_group(peers_done=peers_done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
