"""The machine's figures: each measurement on the real CPU, small enough to take a fraction of a second."""

import pytest
import torch

from gpuforge.hardware import measure

CPU = torch.device("cpu")


def test_stream_bandwidth_counts_each_array_it_reads_and_writes():
    found = measure.stream_bandwidth(CPU, seconds=0.05, array_bytes=8 * 2**20)
    assert set(found) == {"copy_gbs", "triad_gbs"}
    assert all(0.1 < gbs < 10_000 for gbs in found.values())


def test_matmul_peaks_name_each_precision_the_cpu_has_and_skip_what_it_emulates():
    peaks = measure.matmul_peaks(CPU, seconds=0.05)
    assert all(tflops > 1e-3 for tflops in peaks.values()) and "fp32" in peaks  # a GFLOP/s at the least
    assert "tf32" not in peaks  # a CUDA tensor-core mode
    # bf16 and fp16 where this CPU has them (bf16 runs at 1/91 of fp32 on a CPU without AVX-512 BF16)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert (name in peaks) == (not measure.too_slow(CPU, dtype)), (name, peaks)


def test_small_matmuls_reach_less_of_the_peak_than_large_ones():
    # each size's best over its window: on a shared machine a busy moment can take a large size's whole
    # window (CI saw 64 come out on top once), so the best of a few curves, size by size, is compared
    curves = [measure.matmul_curve(CPU, "fp32", seconds=0.2) for _ in range(3)]
    assert all(sorted(curve) == [64, 128, 256, 512, 1024] for curve in curves)
    best = {size: max(curve[size] for curve in curves) for size in curves[0]}
    assert best[64] < max(best.values())


def test_op_overhead_and_special_ops_are_measured_per_operation_and_per_element():
    overhead = measure.op_overhead_s(CPU, seconds=0.05)
    assert 1e-8 < overhead < 1e-3
    special = measure.special_gelems(CPU, seconds=0.05)
    assert set(special) == {"rng", "transcendental"} and all(v > 0 for v in special.values())


def test_host_device_copies_are_for_gpus_only():
    assert measure.host_device_bandwidth(CPU) == {}


@pytest.mark.slow
def test_the_all_reduce_between_two_local_gloo_processes_is_measured():
    found = measure.allreduce_bandwidth("cpu", size_bytes=2**20, runs=2)
    assert found["backend"] == "gloo" and found["processes"] == 2, found
    assert found["bus_gbs"] > 0.001 and found["size_bytes"] == 2**20
