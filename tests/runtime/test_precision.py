"""Precision: what `auto` picks, autocast, and MixedPrecision (the fp16 gradient scaler) on a CPU."""

import math

import pytest
import torch
from torch import nn

from gpuforge.errors import GpuforgeError
from gpuforge.runtime import precision as precision_module
from gpuforge.runtime.precision import MixedPrecision, Precision, autocast, choose_precision

CPU = torch.device("cpu")
INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's default


def _measured(monkeypatch, fp32: float, bf16: float) -> None:
    monkeypatch.setattr(
        precision_module, "peak_flops", lambda device, name: {"fp32": fp32, "bf16": bf16}[name]
    )


def test_a_requested_precision_is_kept_with_its_reason():
    chosen = choose_precision("fp16", CPU)
    assert chosen == Precision("fp16", "asked for in the spec")
    assert chosen.autocast_dtype == torch.float16 and chosen.needs_scaler
    assert Precision("bf16", "").autocast_dtype == torch.bfloat16 and not Precision("bf16", "").needs_scaler
    assert Precision("fp32", "").autocast_dtype is None


@pytest.mark.parametrize(("bf16", "expected"), [(2.0, "bf16"), (1.16, "bf16"), (1.1, "fp32"), (0.5, "fp32")])
def test_auto_on_a_cpu_takes_bf16_only_when_it_is_measurably_faster(monkeypatch, bf16, expected):
    _measured(monkeypatch, fp32=1.0, bf16=bf16)
    chosen = choose_precision("auto", CPU)
    assert chosen.name == expected and chosen.reason.startswith("auto: bf16 matmul measured")


@pytest.mark.parametrize(("supported", "expected"), [(True, "bf16"), (False, "fp16")])
def test_auto_on_a_gpu_follows_its_bf16_support(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
    assert choose_precision("auto", torch.device("cuda")).name == expected


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    with pytest.raises(GpuforgeError, match="train.precision: bf16"):
        choose_precision("bf16", torch.device("cuda"))


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", None)]
)
def test_autocast_runs_matmuls_in_the_precision(name, dtype):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(Precision(name, ""), CPU):
        out = a @ b
    assert out.dtype == (dtype or torch.float32)
    with MixedPrecision(Precision(name, ""), CPU).autocast():
        assert (a @ b).dtype == out.dtype


def _model_and_loss() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    return model, ((model(x) - y) ** 2).mean()  # fp32 ops: the scaled gradients are exact multiples


def _reference_step(lr: float, max_norm: float | None = None) -> list[torch.Tensor]:
    """One plain fp32 SGD step, clipped as MixedPrecision clips: the weights it leaves."""
    model, loss = _model_and_loss()
    loss.backward()
    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return [p.detach().clone() for p in model.parameters()]


def test_fp16_has_a_scaler_on_a_cpu_and_bf16_fp32_have_none():
    assert isinstance(MixedPrecision(Precision("fp16", ""), CPU).scaler, torch.amp.GradScaler)
    assert MixedPrecision(Precision("bf16", ""), CPU).scaler is None
    assert MixedPrecision(Precision("fp32", ""), CPU).scaler is None
    assert MixedPrecision(Precision("fp16", ""), CPU, loss_scaling=False).scaler is None


def test_fp16_backward_scales_and_step_unscales_to_the_plain_update():
    amp = MixedPrecision(Precision("fp16", ""), CPU)
    model, loss = _model_and_loss()
    reference_model, reference_loss = _model_and_loss()
    reference_loss.backward()
    amp.backward(loss)
    # the gradients held between backward and step are the true ones times the scale
    for p, ref in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p.grad, ref.grad * INITIAL_SCALE)
    assert amp.step(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters()) is None
    for p, expected in zip(model.parameters(), _reference_step(lr=0.1), strict=True):
        assert torch.equal(p.detach(), expected)


@pytest.mark.parametrize("name", ["fp16", "fp32"])
def test_step_clips_the_unscaled_gradient_norm(name):
    amp = MixedPrecision(Precision(name, ""), CPU)
    model, loss = _model_and_loss()
    amp.backward(loss)
    amp.step(torch.optim.SGD(model.parameters(), lr=1.0), model.parameters(), max_norm=0.01)
    for p, expected in zip(model.parameters(), _reference_step(lr=1.0, max_norm=0.01), strict=True):
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-7)


def _poisoned(amp: MixedPrecision) -> tuple[nn.Linear, list[torch.Tensor], torch.optim.Optimizer]:
    """A model whose gradients hold NaN after amp.backward, its weights before, and its optimizer."""
    model, loss = _model_and_loss()
    before = [p.detach().clone() for p in model.parameters()]
    amp.backward(loss + torch.sqrt(model.weight.sum() * 0.0))  # adds 0; its gradient is NaN
    return model, before, torch.optim.SGD(model.parameters(), lr=0.1)


def test_without_a_scaler_a_non_finite_gradient_norm_refuses_the_step():
    amp = MixedPrecision(Precision("fp32", ""), CPU)
    model, before, optimizer = _poisoned(amp)
    assert amp.step(optimizer, model.parameters()) == "gradient norm is nan"
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_the_fp16_scaler_skips_a_non_finite_step_and_lowers_its_scale():
    amp = MixedPrecision(Precision("fp16", ""), CPU)
    model, before, optimizer = _poisoned(amp)
    assert amp.step(optimizer, model.parameters()) is None  # not a failure: the scaler's own business
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    assert amp.scaler.get_scale() == INITIAL_SCALE / 2


def test_the_loss_scale_round_trips_through_a_checkpoint_state():
    amp = MixedPrecision(Precision("fp16", ""), CPU)
    model, _, optimizer = _poisoned(amp)
    amp.step(optimizer, model.parameters())  # halves the scale
    state = amp.state_dict()
    resumed = MixedPrecision(Precision("fp16", ""), CPU)
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == INITIAL_SCALE / 2 == amp.scaler.get_scale()
    unscaled = MixedPrecision(Precision("fp32", ""), CPU)
    assert unscaled.state_dict() is None
    unscaled.load_state_dict(state)  # a scaler's state means nothing without a scaler: ignored
    resumed.load_state_dict(None)  # a checkpoint of an unscaled run: the scale stays as it is
    assert unscaled.scaler is None and resumed.scaler.get_scale() == INITIAL_SCALE / 2


def test_fp16_autocast_forward_backward_trains_on_a_cpu():
    amp = MixedPrecision(Precision("fp16", ""), CPU)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(20):
        with amp.autocast():
            logits = model(x)
        assert logits.dtype == torch.float16
        loss = nn.functional.cross_entropy(logits.float(), y)
        amp.backward(loss)
        assert amp.step(optimizer, model.parameters(), max_norm=1.0) is None
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
