"""The learning-rate schedule: warm-up by what trains, and a shape that does not tie itself to a max_steps
the user set only as a ceiling; on real runs, the rates metrics.jsonl logs."""

import json

import pytest
import yaml

from gpuforge.runs import RunDir
from gpuforge.spec import TrainSpec, parse_spec
from gpuforge.train.engine import train
from gpuforge.train.schedule import FINE_TUNE_WARMUP_MAX, WSD_DECAY, Shape
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec


def _shape(trained="full", total=400, **train) -> Shape:
    return Shape.of(TrainSpec(max_steps=total, **train), trained, total)


def test_warm_up_by_what_trains():
    assert _shape("lora").warmup == 0 and "LoRA" in _shape("lora").why
    assert _shape("scratch").warmup == 0
    assert _shape("full", 400).warmup == 20  # 5% of the steps
    assert _shape("full", 100_000).warmup == FINE_TUNE_WARMUP_MAX  # at most 100
    assert _shape("lora", warmup_ratio=0.1).warmup == 40
    assert "train.warmup_ratio" in _shape(warmup_ratio=0.1).why
    assert _shape("lora", warmup_steps=7).warmup == 7


def test_auto_is_cosine_unless_the_run_may_end_before_max_steps():
    assert _shape().kind == "cosine"
    assert _shape(stop_at={"eval_accuracy": 0.9}, eval_every=5).kind == "wsd"
    assert _shape(early_stop={"metric": "eval_loss", "patience": 2}, eval_every=5).kind == "wsd"
    assert _shape(schedule="cosine", stop_at={"eval_accuracy": 0.9}, eval_every=5).kind == "cosine"


def test_wsd_holds_the_rate_then_decays_in_the_last_fifth():
    shape = _shape("lora", 100, schedule="wsd", min_lr_ratio=0.1)
    factors = [shape.factor(s) for s in range(100)]
    decay_from = 100 - round(WSD_DECAY * 100)
    assert factors[:decay_from] == [1.0] * decay_from
    assert all(a > b for a, b in zip(factors[decay_from - 1 :], factors[decay_from:], strict=False))
    assert factors[-1] == pytest.approx(0.1)


def test_constant_and_cosine_after_warm_up():
    constant = _shape("full", 100, schedule="constant")
    assert [constant.factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert constant.factor(99) == 1.0
    cosine = _shape("lora", 100, min_lr_ratio=0.0)
    assert cosine.factor(0) == 1.0 and cosine.factor(50) == pytest.approx(0.5) and cosine.factor(100) == 0.0


def test_a_run_logs_the_rates_its_schedule_gives(tmp_path):
    raw = image_spec(tmp_path, max_steps=10, lr=0.01, schedule="wsd", min_lr_ratio=0.5)
    train(parse_spec(raw, tmp_path), tmp_path / "run")
    rates = [m["lr"] for m in RunDir(tmp_path / "run").metrics()]
    assert rates[:8] == pytest.approx([0.01] * 8)  # a model from scratch: no warm-up; wsd decays in 2 steps
    assert rates[8:] == pytest.approx([0.0075, 0.005])
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    assert "schedule wsd (train.schedule), 0 warm-up steps (a model trained from scratch)" in log


def test_a_run_stored_with_the_old_warm_up_default_still_resumes(tmp_path):
    """Runs stored before the schedule key came held warmup_ratio 0.05, the default then."""
    raw = image_spec(tmp_path, max_steps=2)
    train(parse_spec(raw, tmp_path), tmp_path / "run")
    stored = RunDir(tmp_path / "run").spec_path
    older = yaml.safe_load(stored.read_text())
    del older["train"]["schedule"], older["train"]["eval_max_examples"]
    older["train"]["warmup_ratio"] = 0.05
    stored.write_text(yaml.safe_dump(older, sort_keys=False))
    raw["train"]["max_steps"] = 3
    assert train(parse_spec(raw, tmp_path), tmp_path / "run")["steps"] == 3


def test_a_resumed_run_keeps_the_schedule_its_checkpoint_recorded(tmp_path):
    """stop_at makes auto a wsd today; a checkpoint written before schedules had kinds ran cosine."""
    raw = image_spec(tmp_path, max_steps=10, lr=0.01, eval_every=2, stop_at={"eval_accuracy": 1.01})
    assert train(parse_spec(raw, tmp_path), tmp_path / "run", SignalAt(4))["steps"] == 4
    run = RunDir(tmp_path / "run")
    step, path = run.latest_checkpoint()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["schedule"] == {"kind": "wsd", "warmup": 0}
    del meta["schedule"]  # as an older gpuforge wrote it
    (path / "meta.json").write_text(json.dumps(meta))
    train(parse_spec(raw, tmp_path), tmp_path / "run")
    rates = [m["lr"] for m in run.metrics()]
    assert rates[:5] == pytest.approx([0.01] * 5)  # wsd, as the run began; step 5's rate is the checkpoint's
    cosine = Shape("cosine", 0, 10, 0.1, "")
    assert rates[5:] == pytest.approx([0.01 * cosine.factor(s) for s in range(5, 10)])
    assert "a checkpoint from before train.schedule" in (run.logs_dir / "train.log").read_text()
