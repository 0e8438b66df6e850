"""The per-op roofline: what the trace records of a real step, and the time a roof gives it."""

import pytest
import torch

from gpuforge.hardware.roofline import (
    CONVERSION,
    OpTrace,
    Roof,
    bandwidth_by_size,
    matmul_efficiency,
    saturating_efficiency,
)


def _roof(**changes) -> Roof:
    figures = dict(
        name="test",
        peak_tflops=1.0,
        efficiency=lambda size: 0.5,
        bandwidth=lambda moved, width: 10.0,
        op_overhead_s=1e-6,
    )
    return Roof(**{**figures, **changes})


def test_a_linear_step_is_traced_with_its_flops_and_its_weights_as_fixed_bytes():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    trace = OpTrace.of(lambda: layer(x).sum().backward(), list(layer.parameters()))
    mms = [op for op in trace.ops if op.name == "mm"]
    assert mms and mms[0].flops == 2 * 16 * 64 * 32  # forward: x @ W.T
    assert mms[0].fixed_bytes == 64 * 32 * 4  # the weight: does not grow with the batch
    assert mms[0].batch_bytes == (16 * 64 + 16 * 32) * 4  # input and output do
    assert trace.flops >= 2 * mms[0].flops  # and backward's weight gradient at least


def test_seconds_are_the_slower_of_compute_and_memory_plus_the_overhead_over_the_step_efficiency():
    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(128, 256)
    trace = OpTrace.of(lambda: layer(x), list(layer.parameters()))
    (op,) = trace.ops
    roof = _roof()
    compute = op.flops / (1e12 * 0.5)
    memory = (op.batch_bytes + op.fixed_bytes) / 10e9
    assert trace.ideal_seconds(roof) == pytest.approx(max(compute, memory) + 1e-6)
    assert trace.seconds(_roof(step_efficiency=0.5)) == pytest.approx(2 * trace.ideal_seconds(roof))
    parts = trace.parts(roof)
    assert memory > compute  # 0.5 MB at 10 GB/s outlasts 17 MFLOP at 0.5 TFLOP/s: memory-bound
    assert parts == pytest.approx({"compute_s": 0.0, "memory_s": memory, "overhead_s": 1e-6})
    # twice the batch: twice the FLOPs and the activations' bytes, the weight's bytes the same
    doubled = max(2 * op.flops / (1e12 * 0.5), (2 * op.batch_bytes + op.fixed_bytes) / 10e9) + 1e-6
    assert trace.ideal_seconds(roof, batch_scale=2.0) == pytest.approx(doubled)


def test_an_optimizer_update_does_not_grow_with_the_batch():
    layer = torch.nn.Linear(32, 32)
    layer(torch.randn(4, 32)).sum().backward()
    optimizer = torch.optim.AdamW(layer.parameters())
    optimizer.step()  # its state exists before the traced update
    trace = OpTrace.of(optimizer.step, list(layer.parameters()), batch_free=True)
    assert trace.ops and all(op.weight_only and op.batch_bytes == 0 for op in trace.ops)
    assert trace.ideal_seconds(_roof(), batch_scale=8.0) == trace.ideal_seconds(_roof())


def test_dropout_and_gelu_are_special_ops_and_a_cast_is_a_conversion():
    x = torch.randn(8, 1024)
    trace = OpTrace.of(lambda: torch.nn.functional.gelu(torch.nn.functional.dropout(x, 0.1, training=True)))
    kinds = {op.special for op in trace.ops}
    assert {"rng", "transcendental"} <= kinds
    rng = next(op for op in trace.ops if op.special == "rng")
    slow = _roof(special_gelems={"rng": 1e-3})  # a million elements a second
    assert trace.ideal_seconds(slow) >= rng.elements / 1e6
    cast = OpTrace.of(lambda: x.to(torch.bfloat16))
    assert cast.ops[0].element_bytes == CONVERSION


def test_efficiency_and_bandwidth_curves_interpolate_what_was_measured():
    efficiency = matmul_efficiency({64: 0.1, 1024: 0.8}, peak=1.0)
    assert efficiency(64) == pytest.approx(0.1) and efficiency(1024) == pytest.approx(0.8)
    assert efficiency(256) == pytest.approx(0.1 + 0.7 * 0.5)  # halfway on a log scale
    assert efficiency(4096) == pytest.approx(0.8) and efficiency(32) < 0.1
    gpu = saturating_efficiency(0.75, 768)
    assert gpu(768) == pytest.approx(0.375) and gpu(1e6) == pytest.approx(0.75, rel=1e-3)
    bandwidth = bandwidth_by_size({4: {1: 20.0}, 2: {1: 10.0}, CONVERSION: {1: 5.0}})
    assert bandwidth(1e6, 4) == 20.0 and bandwidth(1e6, 2) == 10.0 and bandwidth(1e6, CONVERSION) == 5.0
    assert bandwidth(1e6, 1) == 10.0 and bandwidth(1e6, 8) == 20.0  # bool as bf16; fp64 as the widest
