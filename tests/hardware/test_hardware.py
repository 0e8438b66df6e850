import json

import torch

from gpuforge.hardware.bench import cache_dir, peak_flops
from gpuforge.hardware.probe import device_name, peak_memory_bytes, select_device
from gpuforge.runtime.precision import choose_precision


def test_auto_device_follows_cuda_then_mps_then_cpu():
    device = select_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else device.type)
    assert select_device("cpu").type == "cpu"


def test_peak_flops_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFORGE_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    first = peak_flops(cpu, "fp32")
    cached = json.loads((cache_dir() / "peak_flops.json").read_text())
    assert cached == {f"{device_name(cpu)}|fp32": first} and first > 1e8
    assert peak_flops(cpu, "fp32") == first  # from the cache, not a second (different) measurement


def test_auto_precision_on_cpu_is_the_faster_measured_one():
    precision = choose_precision("auto", torch.device("cpu"))
    fp32, bf16 = peak_flops(torch.device("cpu"), "fp32"), peak_flops(torch.device("cpu"), "bf16")
    assert precision.name == ("bf16" if bf16 >= 1.15 * fp32 else "fp32")
    assert "measured" in precision.reason


def test_peak_memory_is_reported():
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20
