"""Push bytes over one TCP connection and time them, for tests/launch/test_throttle.py (not collected).

python tests/launch/throttle_probe.py recv HOST PORT
python tests/launch/throttle_probe.py send HOST PORT NBYTES
python tests/launch/throttle_probe.py gloo NFLOATS   (RANK, WORLD_SIZE, MASTER_* from the environment)

``recv`` listens, prints ``listening`` once it can take the connection (so the caller knows when to start the
sender), reads to EOF and prints ``{"bytes": ..., "seconds": ...}``: the time from the accepted connection to
the last byte, i.e. what the link delivered, slow start included. ``send`` writes NBYTES and closes.
``gloo`` joins a gloo group by env://, checks a small all-reduce, then times one of NFLOATS float32s and
prints (rank 0) ``{"sum": ..., "seconds": ..., "bytes": ...}``.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import time

CHUNK = 1 << 16


def recv(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        start = time.perf_counter()
        total = 0
        with conn:
            while data := conn.recv(CHUNK):
                total += len(data)
        print(json.dumps({"bytes": total, "seconds": time.perf_counter() - start}), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    block = b"\0" * CHUNK
    with socket.create_connection((host, port), timeout=30) as conn:
        sent = 0
        while sent < nbytes:
            conn.sendall(block[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


def gloo(nfloats: int) -> None:
    import torch
    import torch.distributed as dist

    from gpuforge.distributed.ranks import leave_process_group

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
    peers_done = False
    try:
        rank = dist.get_rank()
        small = torch.full((4,), float(rank + 1))
        dist.all_reduce(small)
        big = torch.ones(nfloats)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(big)
        seconds = time.perf_counter() - start
        if rank == 0:
            big_ok = bool((big == dist.get_world_size()).all())
            out = {"sum": small.tolist(), "big_ok": big_ok, "seconds": seconds, "bytes": big.numel() * 4}
            print(json.dumps(out), flush=True)
        peers_done = True
    finally:
        leave_process_group(peers_done=peers_done)


if __name__ == "__main__":
    if sys.argv[1] == "gloo":
        gloo(int(sys.argv[2]))
    elif sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
