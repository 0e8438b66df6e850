"""OpenCL platforms and devices, each with a memory bandwidth measured by a small triad kernel of our own.

This is the multi-vendor view: any ICD (PoCL on a CPU, AMD, Intel, NVIDIA) shows up here, with no
vendor library beyond pyopencl. pyopencl is an optional extra, imported lazily.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

INSTALL_HINT = "pip install 'gpuforge[opencl]'"

# Every work-item owns one float4 in each array. init writes real values first: untouched pages would
# read from the kernel's shared zero page and make the triad look faster than the memory is.
_KERNELS = """
__kernel void init(__global float4 *a, __global float4 *b, __global float4 *c) {
    size_t i = get_global_id(0);
    a[i] = (float4)(0.0f);
    b[i] = (float4)(1.0f);
    c[i] = (float4)(2.0f);
}

__kernel void triad(__global float4 *a, __global const float4 *b, __global const float4 *c,
                    const float s) {
    size_t i = get_global_id(0);
    a[i] = b[i] + s * c[i];
}
"""

_TYPES = {"CPU": "cpu", "GPU": "gpu", "ACCELERATOR": "accelerator"}


@dataclass
class OpenCLDevice:
    platform: str  # platform name, e.g. "Portable Computing Language"
    name: str
    type: str  # "cpu" | "gpu" | "accelerator" | "other"
    vendor: str
    version: str  # the device's OpenCL version string
    compute_units: int
    clock_mhz: int
    global_memory_bytes: int
    memory_bandwidth_gbs: float | None  # measured triad GB/s (1e9), best of a few runs; None if it failed
    error: str | None = None  # why it could not be measured (the device is still listed)


def opencl_devices(measure: bool = True, seconds: float = 0.5) -> tuple[list[OpenCLDevice], str | None]:
    """Every OpenCL device on every platform, measured; the second item is one line saying why there are
    none, else None. Never raises for a missing runtime."""
    try:
        import pyopencl as cl
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "pyopencl":
            return [], f"no OpenCL: pyopencl is not installed ({INSTALL_HINT})"
        return [], f"no OpenCL: pyopencl failed to import: {_one_line(e)}"

    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        # the ICD loader raises PLATFORM_NOT_FOUND_KHR rather than returning an empty list
        if "PLATFORM_NOT_FOUND" not in str(e):
            return [], f"no OpenCL platform: {_one_line(e)}"
        platforms = []
    if not platforms:
        return [], f"no OpenCL platform: install an ICD such as PoCL ({INSTALL_HINT} brings PoCL for the CPU)"

    devices = []
    for platform in platforms:
        try:
            found = platform.get_devices()
        except cl.Error:
            continue  # DEVICE_NOT_FOUND: a platform with nothing on this machine
        for dev in found:
            devices.append(_describe(cl, platform, dev, measure, seconds))
    if not devices:
        names = ", ".join(p.name for p in platforms)
        return [], f"no OpenCL device: the platforms ({names}) report none"
    return devices, None


def _describe(cl, platform, dev, measure: bool, seconds: float) -> OpenCLDevice:
    kind = cl.device_type.to_string(dev.type).split()  # a bit set, e.g. "CPU" or "GPU DEFAULT"
    device = OpenCLDevice(
        platform=platform.name.strip(),
        name=dev.name.strip(),
        type=next((_TYPES[k] for k in kind if k in _TYPES), "other"),
        vendor=dev.vendor.strip(),
        version=dev.version.strip(),
        compute_units=int(dev.max_compute_units),
        clock_mhz=int(dev.max_clock_frequency),
        global_memory_bytes=int(dev.global_mem_size),
        memory_bandwidth_gbs=None,
    )
    if measure:
        try:
            device.memory_bandwidth_gbs = _triad_gbs(cl, dev, seconds)
        except Exception as e:  # a driver's build or runtime failure is this device's, not the listing's
            device.error = _one_line(e)
    return device


def _triad_gbs(cl, dev, seconds: float) -> float:
    """Best triad bandwidth over a few runs, timed by the device's own events, within about `seconds`."""
    import numpy as np

    # Big enough to leave the caches, small enough to be quick: a CPU with 2 cores must finish in time.
    cap = 64 * 2**20 if dev.type & cl.device_type.CPU else 256 * 2**20
    per_array = min(cap, dev.global_mem_size // 8, dev.max_mem_alloc_size)
    n = per_array // 16  # float4 elements
    if n < 1024:
        raise RuntimeError(f"too little device memory to measure ({dev.global_mem_size} bytes)")

    start = time.perf_counter()
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyopencl warns on any non-empty build log
        program = cl.Program(ctx, _KERNELS).build()
    init, triad = cl.Kernel(program, "init"), cl.Kernel(program, "triad")
    buffers = [cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n * 16) for _ in range(3)]
    try:
        init(queue, (n,), None, *buffers)
        triad(queue, (n,), None, *buffers, np.float32(3.0)).wait()  # warm-up: code paths, TLBs
        best, runs = 0.0, 0
        # at least 3 timed runs, then more while the time budget (counted from context creation) lasts
        while runs < 3 or (time.perf_counter() - start < seconds and runs < 50):
            event = triad(queue, (n,), None, *buffers, np.float32(3.0))
            event.wait()
            runs += 1
            ns = event.profile.end - event.profile.start
            if ns > 0:
                best = max(best, 3 * n * 16 / ns)  # bytes per ns is GB/s: two reads and one write
        queue.finish()
    finally:
        for buf in buffers:
            buf.release()
    if best <= 0:
        raise RuntimeError("the device's profiling events reported no time")
    return best


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
