"""What a device can do, measured: memory bandwidth, matmul speed per precision and size, the cost of one
small operation, host<->device copies, and the all-reduce between local processes.

These are the figures the article's table compares (cores, memory bandwidth) and the ones the plan's
roofline needs (hardware/roofline.py). Each is short (a fraction of a second), best of a few runs: a
shared machine's noise only ever makes a run slower, so the best run is the closest to what the device
can do.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpuforge.child_env import child_environment
from gpuforge.hardware.bench import DTYPES, measure_matmul_flops
from gpuforge.hardware.probe import synchronize

GB = 1e9
MATMUL_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # the curve a small model's matmuls fall on


def best_time(run: Callable[[], None], device: torch.device, seconds: float, min_runs: int = 3) -> float:
    """The fastest of repeated runs (after one warm-up), for at least `seconds` or `min_runs` runs."""
    run()
    synchronize(device)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or spent < seconds:
        start = time.perf_counter()
        run()
        synchronize(device)
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


def stream_bandwidth(device: torch.device, seconds: float = 0.3, array_bytes: int | None = None) -> dict:
    """STREAM-like copy (a = b) and triad (a = b + s*c) in GB/s: reads and writes each count once.

    Arrays are far larger than the caches (64 MiB each on a CPU, 1 GiB on a GPU), so this is the memory's
    speed, not a cache's."""
    if array_bytes is None:
        array_bytes = stream_array_bytes(device)
    n = array_bytes // 4
    a = torch.empty(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.full((n,), 2.0, device=device)
    copy = best_time(lambda: a.copy_(b), device, seconds / 2)
    triad = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), device, seconds / 2)
    return {"copy_gbs": 2 * array_bytes / copy / GB, "triad_gbs": 3 * array_bytes / triad / GB}


def stream_array_bytes(device: torch.device) -> int:
    """Arrays far larger than the caches: 4x the last-level cache on a CPU (at least 64 MiB), 1 GiB on a GPU
    (an eighth of its memory at most, three arrays with room to spare)."""
    if device.type == "cuda":
        return min(2**30, torch.cuda.get_device_properties(device).total_memory // 8)
    if device.type != "cpu":
        return 256 * 2**20
    return min(2**30, max(64 * 2**20, 4 * last_level_cache_bytes()))


def last_level_cache_bytes() -> int:
    """The largest cache /sys lists for CPU 0 (0 where there is no /sys)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = index.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def matmul_peaks(
    device: torch.device,
    seconds: float = 0.3,
    only: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "int8"),
) -> dict[str, float]:
    """Matmul TFLOP/s per precision the device has: fp32, tf32 (CUDA from Ampere), bf16, fp16, int8 (TOPS)."""
    out: dict[str, float] = {}
    for precision in ("fp32", "bf16", "fp16"):
        if precision not in only or too_slow(device, DTYPES[precision]):
            continue  # an emulated type (fp16 on most CPUs): seconds per matmul, nothing a job would use
        out[precision] = measure_matmul_flops(device, DTYPES[precision], seconds) / 1e12
    if "tf32" in only and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            out["tf32"] = measure_matmul_flops(device, torch.float32, seconds) / 1e12
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    int8 = int8_matmul_tops(device, seconds) if "int8" in only else None
    if int8:
        out["int8"] = int8
    return out


def too_slow(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matmuls in `dtype` are emulated: a 256-square one over 10x fp32's time (fp32 is native
    everywhere; this CPU's emulated fp16 is 60x). Against fp32 measured alternately, not against a fixed
    time: on a busy machine every run can lose its core for milliseconds, fp32's too (seen under CI). The
    best of many runs each (30 of fp32's 0.2 ms, 9 of the other's): a judgement that every one of them
    was slowed is what went wrong before, once with 3 of fp32's (fp16 was kept, at 1/55 of fp32)."""
    if dtype == torch.float32:
        return False
    reference = torch.ones(256, 256, device=device)
    a = reference.to(dtype)
    fp32 = other = float("inf")
    for _ in range(3):
        fp32 = min(fp32, best_time(lambda: reference @ reference, device, 0.0, min_runs=10))
        other = min(other, best_time(lambda: a @ a, device, 0.0, min_runs=3))
    return other > 10 * fp32


def int8_matmul_tops(device: torch.device, seconds: float) -> float | None:
    """int8 x int8 -> int32 matmul TOPS through torch._int_mm; None where this build has no such kernel."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randint(-100, 100, (n, n), dtype=torch.int8, device=device)
    try:
        took = best_time(lambda: torch._int_mm(a, a), device, seconds)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return 2 * n**3 / took / 1e12


def matmul_curve(device: torch.device, precision: str, seconds: float = 0.4) -> dict[int, float]:
    """TFLOP/s of square matmuls by size: small ones reach a fraction of the peak (the roofline's
    compute efficiency for a model's real shapes)."""
    dtype = DTYPES[precision]
    largest = 4096 if device.type == "cuda" else 1024
    sizes = [n for n in MATMUL_SIZES if n <= largest]
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        took = best_time(lambda a=a: a @ a, device, seconds / len(sizes))
        out[n] = 2 * n**3 / took / 1e12
    return out


ELEMENTWISE_SIZES = (2**14, 2**16, 2**18, 2**20, 2**22, 2**24)  # elements: from a cache's share to memory's


def elementwise_curve(
    device: torch.device, precision: str, seconds: float = 0.4, sizes: tuple[int, ...] = ELEMENTWISE_SIZES
) -> dict[int, float]:
    """GB/s of an elementwise multiply (two reads, one write) by the bytes it moves: small tensors stay in
    a CPU's caches and go faster than memory; bf16 on a CPU converts each element and goes slower.
    `precision` "convert": an fp32 -> bf16 copy, autocast's cast."""
    out = {}
    for n in sizes:
        if precision == "convert":  # fp32 -> bf16, as autocast casts weights and activations
            a, c = torch.ones(n, device=device), torch.empty(n, device=device, dtype=torch.bfloat16)
            moved = 6 * n

            def run(a=a, c=c):
                c.copy_(a)
        else:
            dtype = DTYPES[precision]
            a, b = torch.ones(n, device=device, dtype=dtype), torch.ones(n, device=device, dtype=dtype)
            c = torch.empty(n, device=device, dtype=dtype)
            moved = 3 * n * a.element_size()

            def run(a=a, b=b, c=c):
                torch.mul(a, b, out=c)

        out[moved] = moved / best_time(run, device, seconds / len(sizes)) / GB
    return out


def special_gelems(device: torch.device, seconds: float = 0.3) -> dict[str, float]:
    """Elements a second (1e9) of the ops a CPU computes slower than it moves: random integers (dropout's
    masks) and a transcendental function (GELU: erf)."""
    n = 2**20
    x = torch.ones(n, device=device)
    rng = best_time(
        lambda: torch.randint(0, 2**15, (n,), dtype=torch.int16, device=device), device, seconds / 2
    )
    gelu = best_time(lambda: torch.nn.functional.gelu(x), device, seconds / 2)
    return {"rng": n / rng / 1e9, "transcendental": n / gelu / 1e9}


def op_overhead_s(device: torch.device, seconds: float = 0.2) -> float:
    """Seconds one operation of a training step costs beyond its work: Python, dispatch and autograd's
    bookkeeping on a CPU, launch on a GPU. Tiny ops forward and backward, divided by the operations they
    dispatch (as the plan's trace counts them)."""
    from gpuforge.hardware.roofline import OpTrace

    x = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()

    ops = len(OpTrace.of(chain).ops)
    return best_time(chain, device, seconds) / max(1, ops)


def host_device_bandwidth(device: torch.device, seconds: float = 0.4, size_bytes: int = 256 * 2**20) -> dict:
    """Host->device and device->host GB/s, from pinned and from pageable host memory (GPUs only)."""
    if device.type != "cuda":
        return {}
    n = size_bytes // 4
    on_device = torch.empty(n, device=device)
    out = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(n, pin_memory=pinned)
        h2d = best_time(lambda h=host, p=pinned: on_device.copy_(h, non_blocking=p), device, seconds / 4)
        d2h = best_time(lambda h=host, p=pinned: h.copy_(on_device, non_blocking=p), device, seconds / 4)
        out[f"h2d_{kind}_gbs"] = size_bytes / h2d / GB
        out[f"d2h_{kind}_gbs"] = size_bytes / d2h / GB
    return out


def reference_step(device: torch.device, precision: str) -> Callable[[], None]:
    """One training step of a small transformer of our own (2 layers, width 384, 32 tokens, batch 32,
    dropout 0.1: the shape of a small fine-tuning job), with AdamW, in `precision`: how far a real step
    falls short of the roofline on this device."""
    g = torch.Generator(device="cpu").manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(384, 6, 1536, dropout=0.1, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).to(device)
    head = torch.nn.Linear(384, 8).to(device)
    params = [*model.parameters(), *head.parameters()]
    fused = device.type in ("cuda", "cpu")  # as training's own optimizer (train/step.py)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    x = torch.randn(32, 32, 384, generator=g).to(device)
    y = torch.randint(0, 8, (32,), generator=g).to(device)
    dtype = DTYPES[precision]

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
            loss = torch.nn.functional.cross_entropy(head(model(x).mean(1)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# --- the all-reduce between local processes: gloo on CPUs, NCCL between GPUs ---------------------------


def allreduce_bandwidth(
    device_type: str = "cpu", size_bytes: int = 32 * 2**20, runs: int = 5, timeout_s: float = 90
) -> dict:
    """The bus bandwidth (GB/s) of an all-reduce between local processes: two on a CPU (gloo), one per GPU
    (NCCL) where there are two or more; {} where there is nothing to reduce between. A failure is
    reported in `error`, never raised: the rest of `gpuforge hw` stands without it."""
    world = torch.cuda.device_count() if device_type == "cuda" else 2
    if world < 2:
        return {}
    backend = "nccl" if device_type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="gpuforge-allreduce-") as tmp:
        result = os.path.join(tmp, "result")
        args = [backend, str(world), str(_free_port()), str(size_bytes), str(runs), result]
        # loopback only: the measurement is between processes of this machine, and opens nothing to others
        env = child_environment(
            {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        )
        logs = [open(os.path.join(tmp, f"rank{rank}.log"), "w+b") for rank in range(world)]
        ranks = [
            subprocess.Popen(
                [sys.executable, "-m", "gpuforge.hardware.measure", str(rank), *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs[rank],
            )
            for rank in range(world)
        ]
        try:
            error = _wait_all(ranks, logs, time.monotonic() + timeout_s)
        finally:
            for process in ranks:  # one that failed leaves its peers waiting for it: none outlives this call
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for log in logs:
                log.close()
        if error:
            return {"backend": backend, "processes": world, "error": error}
        with open(result) as f:
            took = float(f.read())
    # a ring all-reduce moves 2(n-1)/n of the buffer through each link: the "bus bandwidth" NCCL's tests print
    bus = 2 * (world - 1) / world * size_bytes / took / GB
    return {"backend": backend, "processes": world, "bus_gbs": bus, "size_bytes": size_bytes}


def _wait_all(ranks: list[subprocess.Popen], logs, deadline: float) -> str | None:
    """None once every rank exited 0; else the first failure's last line (or a timeout)."""
    while any(p.poll() is None for p in ranks):
        failed = next((i for i, p in enumerate(ranks) if p.returncode not in (None, 0)), None)
        if failed is not None:
            break
        if time.monotonic() > deadline:
            return "timed out waiting for the ranks"
        time.sleep(0.05)
    for i, process in enumerate(ranks):
        if process.returncode not in (None, 0):
            logs[i].seek(0)
            lines = logs[i].read().decode(errors="replace").strip().splitlines()
            return f"rank {i} exited {process.returncode}: {lines[-1] if lines else 'no output'}"
    return None


def _allreduce_rank(rank: int, backend: str, world: int, port: int, size_bytes: int, runs: int, result: str):
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),  # a peer that died is noticed, not waited for
    )
    try:
        buffer = torch.ones(size_bytes // 4, device=device)
        dist.all_reduce(buffer)  # warm-up: connections, buffers
        synchronize(device)
        best = float("inf")
        for _ in range(runs):  # the same count on every rank: one that stopped early would hang the others
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        flag = torch.tensor([best], device=device)  # the slowest rank's best is the collective's time
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(result, "w") as f:
                f.write(str(float(flag)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # one rank of allreduce_bandwidth: RANK BACKEND WORLD PORT BYTES RUNS RESULT
    rank_, backend_, world_, port_, size_, runs_, result_ = sys.argv[1:8]
    _allreduce_rank(int(rank_), backend_, int(world_), int(port_), int(size_), int(runs_), result_)
