"""Pick the device a job runs on and describe it: cuda > mps > cpu unless the spec says otherwise."""

from __future__ import annotations

import platform
import resource
import sys
from functools import cache

import torch

from gpuforge.errors import GpuforgeError


def select_device(device_type: str = "auto") -> torch.device:
    """The best available device, or the one asked for (an error if it is not there)."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device_type == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if has_mps else torch.device("cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise GpuforgeError("resources.device_type: cuda was asked for but torch sees no CUDA device")
    if device_type == "mps" and not has_mps:
        raise GpuforgeError("resources.device_type: mps was asked for but torch sees no MPS device")
    return torch.device(device_type)


@cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """A stable human-readable name, also the key of the per-machine benchmark cache."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return f"{cpu_model_name()} x{torch.get_num_threads()} threads"


def proc_status_bytes(key: str) -> int | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes this process held on the device: allocator peak on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    peak = proc_status_bytes("VmHWM")  # this process's own peak (ru_maxrss survives exec: the parent's)
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def release_memory(device: torch.device) -> None:
    """What an out-of-memory error left cached, back to the device before a retry."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
