"""What a process that holds a fraction of a device does with it (the server's scheduler/sharing.py
decides the fraction and sets these variables): pin itself to its cores at start, cap PyTorch's CUDA
allocator at its share, and name the cap when it runs out of memory under it."""

from __future__ import annotations

import os

PIN_VARIABLE = "GPUFORGE_CPU_CORES"  # the cores a process pins itself to at start (gpuforge.__main__)
MEMORY_FRACTION_VARIABLE = "GPUFORGE_CUDA_MEMORY_FRACTION"  # the PyTorch allocator's cap, a fraction
MEMORY_CAP_VARIABLE = "GPUFORGE_CUDA_MEMORY_CAP"  # the same cap in bytes, for the failure's reason
SHARE_VARIABLE = "GPUFORGE_DEVICE_SHARE"  # the fraction held: energy per step, the failure's reason
NICE_VARIABLE = "GPUFORGE_CPU_NICE"  # a training job on a share of a slot yields to serving and the server


def pin_from_environment() -> None:
    """Pin this process to GPUFORGE_CPU_CORES when the server gave it a share of a slot: before torch or
    any library starts a thread, so that every thread and child inherits the cores."""
    given = os.environ.get(PIN_VARIABLE)
    if not given or not hasattr(os, "sched_setaffinity"):
        return
    nice = os.environ.get(NICE_VARIABLE, "")
    if nice.isdigit():  # only ever lower: a job cannot raise itself above the server
        try:
            os.nice(min(int(nice), 19))
        except OSError:
            pass
    try:
        os.sched_setaffinity(0, {int(c) for c in given.split(",")})
    except (ValueError, OSError) as err:  # a core gone since (a container resized): run unpinned, say so
        print(f"gpuforge: not pinned to cores {given}: {err}", flush=True)


def memory_cap() -> tuple[float, int] | None:
    """(the share, the cap in bytes) this process's CUDA memory is capped at; None: no cap."""
    fraction, cap = os.environ.get(MEMORY_FRACTION_VARIABLE), os.environ.get(MEMORY_CAP_VARIABLE)
    try:
        return (float(fraction), int(cap)) if fraction and cap else None
    except ValueError:
        return None


def cap_cuda_memory(device) -> str | None:
    """Cap PyTorch's allocator on `device` (a CUDA torch.device) at the share the server gave; what was
    capped, in words, or None where nothing is."""
    capped = memory_cap()
    if capped is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    torch.cuda.set_per_process_memory_fraction(capped[0], device)
    return over_cap_words(capped)


def over_cap_words(capped: tuple[float, int]) -> str:
    share, cap = capped
    return f"its memory cap of {cap / 2**30:.1f} GiB (resources.devices {share:g} of the GPU)"
