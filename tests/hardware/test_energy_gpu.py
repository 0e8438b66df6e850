"""NVML's total-energy counter on a real GPU: it grows around a matmul loop, and the meter charges a half
share half of it. Run by scripts/gpu_check.sh (its file name says gpu); skipped without CUDA."""

import os
import time

import pytest
import torch

from gpuforge.hardware.energy import EnergyMeter, Holder, NvmlReader

pytestmark = pytest.mark.gpu


def _physical_index() -> int:
    """cuda:0's NVML index: the first of CUDA_VISIBLE_DEVICES, or 0 where every GPU is visible."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def test_the_energy_counter_grows_around_a_matmul_loop():
    nvml = NvmlReader()
    assert nvml.available(), "NVML: is nvidia-ml-py installed (scripts/gpu_wheels.sh carries it)?"
    index = _physical_index()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    meter = EnergyMeter(nvml=nvml)
    half = Holder("job:1", "cuda", (index,), 0.5, (os.getpid(),), 0, None, None)
    assert meter.measure([half]) == {}
    before = nvml.energy_j(index)
    start = time.perf_counter()
    busy: list[float] = []
    while time.perf_counter() - start < 1.0:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        busy.append(nvml.utilisation(index) or 0.0)
    time.sleep(0.2)  # the counter is updated every 20-100 ms: let it catch up with the last kernels
    seconds = time.perf_counter() - start
    after = nvml.energy_j(index)
    reading = meter.measure([half])["job:1"]
    assert before is not None and after is not None
    used = after - before
    print(f"NVML cuda:{index}: {used:.1f} J in {seconds:.2f} s ({used / seconds:.0f} W), {reading.rule}")
    assert used > 10  # a second of large matmuls: far above 10 W on any datacenter GPU
    assert reading.source == "nvml" and reading.joules == pytest.approx(used * 0.5, rel=0.1)
    assert reading.rule == f"NVML total-energy counter of cuda:{index} x 0.5 (the job's share of the device)"
    assert max(busy) > 0.5  # NVML's utilisation saw the kernels
