"""Measured device speed: a short matmul run per (device, dtype), cached per machine.

MFU is achieved FLOP/s over this measured peak, so it is comparable across machines whose datasheet
numbers we do not know (a CPU, a throttled laptop GPU).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from gpuforge.hardware.probe import device_name, synchronize
from gpuforge.settings import current

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cache_dir() -> Path:
    return current().cache_dir


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """FLOP/s of square matmuls on `device` in `dtype`, after one warm-up."""
    n = 4096 if device.type == "cuda" else 1024
    g = torch.Generator(device=device).manual_seed(
        0
    )  # private: a training's global RNG stream stays untouched
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    a @ b
    synchronize(device)
    reps, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        reps += 4
        synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * reps / elapsed


def forget_peaks() -> None:
    """Drop the cached peaks: the next peak_flops measures again (`gpuforge hw --refresh`)."""
    (cache_dir() / "peak_flops.json").unlink(missing_ok=True)


def peak_flops(device: torch.device, precision: str) -> float:
    """Measured matmul FLOP/s for this device and precision, measured once per machine then cached."""
    key = f"{device_name(device)}|{precision}"
    path = cache_dir() / "peak_flops.json"
    cached = read_cache(path)
    if isinstance(cached.get(key), int | float):
        return float(cached[key])
    value = measure_matmul_flops(device, DTYPES[precision])
    write_cache(path, {**read_cache(path), key: value})
    return value


def read_cache(path: Path) -> dict:
    """A cache file's mapping; {} for a missing, unreadable or damaged one (measured again)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def write_cache(path: Path, data: dict) -> None:
    """Replace a cache file whole (no reader sees half of it); a read-only one costs a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
