"""What a 1 GiB request body sent without a key does to a server's resident memory, on both servers.

    python benchmarks/unauthenticated_body_memory.py [--gib 1] [--floor-mib 50] [--only serve|server]

Two server processes on loopback, each started here:
  serve    `gpuforge serve` on a digits CNN trained here for a few steps, its key in GPUFORGE_API_KEY
           (default --max-body-bytes); route POST /predict
  server   the team server `gpuforge server` (LocalServer, a temporary GPUFORGE_HOME); routes POST
           /api/v1/jobs and PUT /api/v1/uploads/<64 hex>
To each route the client sends the body twice, without a key: once with a Content-Length, once chunked
(Transfer-Encoding: chunked, no length). It writes the request over a plain socket from a generator of
1 MiB pieces (it never holds more than one), and stops writing once the server has answered or closed
the connection. Memory is the server process's own, from /proc/<pid>/status: VmRSS before and 0.5 s
after the request, and VmHWM, its peak, reset to the current RSS just before the request (by writing 5
to /proc/<pid>/clear_refs). A refusal before reading shows up as a status sent at once (or "closed": the
connection reset while the client still wrote), little sent, and no growth.
Floor (issue "A server a team can share safely"): the body leaves the server's RSS, peak included,
within 50 MiB of where it was.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


from gpuforge.runtime.host import free_port  # noqa: E402
from gpuforge.server.local import LocalServer, wait_until_ready  # noqa: E402

MIB = 1 << 20
PIECE = b"x" * MIB  # the only copy of the body the client holds
SEND_TIMEOUT_S = 30.0  # a server that neither reads nor answers: "stalled"


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> bool:
    """VmHWM back to the current RSS (Linux 4.0+); False where that is not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def pieces(size: int, chunked: bool) -> Iterator[bytes]:
    left = size
    while left > 0:
        piece = PIECE if left >= MIB else PIECE[:left]
        left -= len(piece)
        yield b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece
    if chunked:
        yield b"0\r\n\r\n"


def send(url: str, method: str, path: str, size: int, chunked: bool) -> tuple[str, int]:
    """(what the client saw: an HTTP status, "closed" or "stalled"; body bytes it got to write)."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    sent = 0
    with socket.create_connection((host, int(port)), timeout=SEND_TIMEOUT_S) as sock:
        try:
            sock.sendall(head.encode())
            for piece in pieces(size, chunked):
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered (or closed) before the body's end: stop writing
                sock.sendall(piece)
                sent += len(piece)
        except TimeoutError:
            return "stalled", sent
        except OSError:
            pass  # reset while writing: whatever answer came before it may still be readable
        return read_status(sock), sent


def read_status(sock: socket.socket) -> str:
    answer = b""
    try:
        while b"\r\n" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    except OSError:
        pass
    parts = answer.split(b" ", 2)
    return parts[1].decode() if answer.startswith(b"HTTP/") and len(parts) > 1 else "closed"


def measure(name, pid, url, method, path, size, chunked) -> dict:
    before = status_kib(pid, "VmRSS")
    peak_reset = reset_peak(pid)
    started = time.perf_counter()
    code, sent = send(url, method, path, size, chunked)
    seconds = time.perf_counter() - started
    time.sleep(0.5)  # what the server does after answering (freeing, or still reading) settles
    after, peak = status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM")
    route = f"{method} {re.sub('[0-9a-f]{64}', '<sha256>', path.split('?')[0])}"
    return {
        "server": name, "route": route, "sent as": "chunked" if chunked else "length",
        "status": code, "client wrote MiB": sent / MIB, "seconds": seconds, "rss before MiB": before / 1024,
        "rss after MiB": after / 1024, "peak growth MiB": (peak - before) / 1024, "peak_reset": peak_reset,
    }  # fmt: skip


def digits_model(tmp: Path) -> Path:
    from gpuforge.spec import load_spec
    from gpuforge.train.engine import train

    overrides = ["train.max_steps=3", "train.precision=fp32", "train.eval_every=1000"]
    overrides += ["compress.prune=null", "compress.quantize=null"]
    train(load_spec(ROOT / "examples" / "digits-cnn.yaml", overrides), tmp / "run")
    return tmp / "run" / "model"


def start_serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "GPUFORGE_API_KEY": f"gf_{secrets.token_hex(20)}"}
    env.pop("GPUFORGE_PUBLIC_METRICS", None)
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuforge", "serve", str(model_dir), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    if wait_until_ready(url, process, 120):
        return process, url
    process.kill()
    raise SystemExit(f"gpuforge serve did not get ready; see {log}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def print_table(rows: list[dict], floor_mib: float) -> None:
    heads = ["server", "route", "sent as", "status", "client wrote MiB", "seconds", "rss before MiB",
             "rss after MiB", "peak growth MiB", "verdict"]  # fmt: skip
    cells = []
    for r in rows:
        growth = max(r["rss after MiB"] - r["rss before MiB"], r["peak growth MiB"])
        verdict = "PASS" if growth <= floor_mib else "BELOW"
        cells.append([
            r["server"], r["route"], r["sent as"], r["status"], f"{r['client wrote MiB']:.1f}",
            f"{r['seconds']:.2f}", f"{r['rss before MiB']:.1f}", f"{r['rss after MiB']:.1f}",
            f"{r['peak growth MiB']:.1f}" + ("" if r["peak_reset"] else " (peak not reset)"), verdict,
        ])  # fmt: skip
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    for line in [heads, ["-" * w for w in widths], *cells]:  # text columns to the left, figures to the right
        padded = (
            c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        print("  ".join(padded))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the body's size")
    parser.add_argument("--floor-mib", type=float, default=50.0)
    parser.add_argument("--only", choices=("serve", "server"))
    args = parser.parse_args()
    size, rows = int(args.gib * (1 << 30)), []
    with tempfile.TemporaryDirectory(prefix="gpuforge-body-") as tmp:
        tmp = Path(tmp)
        if args.only in (None, "serve"):
            process, url = start_serve(digits_model(tmp), tmp / "serve.log")
            try:
                for chunked in (False, True):
                    rows.append(measure("serve", process.pid, url, "POST", "/predict", size, chunked))
            finally:
                stop(process)
        if args.only in (None, "server"):
            with LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_CPU_SLOTS="1") as server:
                upload = f"/api/v1/uploads/{secrets.token_hex(32)}?name=data.bin"
                pid, url = server.process.pid, server.url
                for method, path in (("POST", "/api/v1/jobs"), ("PUT", upload)):
                    for chunked in (False, True):
                        rows.append(measure("server", pid, url, method, path, size, chunked))
    print(f"a {args.gib:g} GiB body without a key, each server its own process; "
          f"floor: RSS and its peak within {args.floor_mib:g} MiB of before")  # fmt: skip
    print_table(rows, args.floor_mib)


if __name__ == "__main__":
    main()
