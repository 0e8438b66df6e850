"""train.lr auto: the range test's rule on curves, and on real runs that it puts everything back (the run
after it is the run with the picked rate), writes its curve, counts in the plan, and runs once per run."""

import json
import math

import pytest

from gpuforge.plan import make_plan
from gpuforge.run_files import read_lr_find
from gpuforge.runs import RunDir
from gpuforge.spec import parse_spec
from gpuforge.train.engine import train
from gpuforge.train.lr_find import MAX_LR, MIN_LR, STEPS, pick, rate_at, rise_at
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec


def _train(tmp_path, raw, out="run", reporter=None):
    return train(parse_spec(raw, tmp_path), tmp_path / out, reporter)


def test_the_rates_run_from_min_to_max_on_a_log_scale():
    rates = [rate_at(i) for i in range(STEPS)]
    assert rates[0] == pytest.approx(MIN_LR) and rates[-1] == pytest.approx(MAX_LR)
    ratios = {round(b / a, 9) for a, b in zip(rates, rates[1:], strict=False)}
    assert len(ratios) == 1  # evenly spaced in log(lr)


def test_the_pick_is_a_twentieth_of_the_highest_rate_before_the_loss_rose():
    lrs = [10.0**k for k in range(-5, 1)]  # 1e-5 .. 1
    flat_then_up = [0.69, 0.69, 0.691, 0.689, 0.9, 1.5]  # flat (noise) to 1e-2, up at 1e-1
    assert rise_at(flat_then_up) == 4
    lr, why = pick(lrs, flat_then_up)
    assert lr == pytest.approx(1e-2 / 20) and "(0.01; it rose at 0.1)" in why
    assert pick(lrs, [2.0, 1.5, 1.0, 0.6, 0.4, 0.3])[0] == pytest.approx(1 / 20)  # it never rose
    assert "never rose" in pick(lrs, [2.0, 1.5, 1.0, 0.6, 0.4, 0.3])[1]
    assert rise_at([1.0, 0.9, math.nan]) == 2  # not finite: past the rise too


def test_a_rise_counts_from_the_fourth_step_and_a_loss_not_finite_at_once_picks_below_the_range():
    assert rise_at([1.0, 1.5, 2.0, 2.5]) == 3  # steps 1-2 moved by a batch's noise count for nothing
    lr, why = pick([1e-5, 1e-4, 1e-3], [math.inf])
    assert lr == pytest.approx(1e-5 / 20) and "rose at once" in why


def test_an_auto_run_is_the_run_with_the_rate_it_picked(tmp_path):
    """The test's steps leave no trace: the weights, dropout's RNG and the data order are put back, so the
    run after it follows the curve of a run told the picked rate from the start."""
    auto = _train(tmp_path, image_spec(tmp_path, max_steps=8, lr="auto", eval_every=4), "auto")
    run = RunDir(tmp_path / "auto")
    test = json.loads(run.lr_find_path.read_text())
    assert test["steps"] <= STEPS and len(test["losses"]) == test["steps"] and test["seconds"] > 0
    assert test["rule"] and test["reason"].startswith(f"lr {test['lr']:.3g}")
    found = [e for e in run.events() if e["event"] == "lr_found"]
    assert len(found) == 1 and found[0]["lr"] == test["lr"]
    started = next(e for e in run.events() if e["event"] == "started")
    assert started["lr"] == pytest.approx(test["lr"])
    told = _train(tmp_path, image_spec(tmp_path, max_steps=8, lr=test["lr"], eval_every=4), "told")
    ours, theirs = list(run.metrics()), list(RunDir(tmp_path / "told").metrics())
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in theirs], rel=1e-6)
    assert [m["lr"] for m in ours] == pytest.approx([m["lr"] for m in theirs], rel=1e-9)
    assert auto["eval"] == pytest.approx(told["eval"], rel=1e-6)
    # its seconds count in the run's (the wall time holds them; the steps' own time does not)
    assert auto["wall_s"] > test["seconds"]
    record = read_lr_find(run.root)
    assert record["lr"] == test["lr"] and len(record["points"]) == test["steps"]


def test_a_resumed_auto_run_keeps_its_rate_and_runs_no_second_test(tmp_path):
    raw = image_spec(tmp_path, max_steps=10, checkpoint_every=4, lr="auto")
    reference = _train(tmp_path, raw, "reference")
    assert _train(tmp_path, raw, "run", SignalAt(5))["status"] == "cancelled"
    resumed = _train(tmp_path, raw, "run")
    run = RunDir(tmp_path / "run")
    assert resumed["resumed_from"] == 5 and resumed["final_loss"] == pytest.approx(reference["final_loss"])
    assert [e["event"] for e in run.events()].count("lr_found") == 1
    reference_lrs = [m["lr"] for m in RunDir(tmp_path / "reference").metrics()]
    assert [m["lr"] for m in run.metrics()] == pytest.approx(reference_lrs, rel=1e-9)


@pytest.mark.parametrize(
    "written",
    [
        b"{not json",
        b'{"lr": "0.1", "lrs": [], "losses": []}',
        b'{"lr": -1, "lrs": [], "losses": []}',
        b'{"lr": 1e400, "lrs": [], "losses": []}',
        b'{"lr": 0.01, "lrs": 5, "losses": []}',
        b"[" * 100_000 + b"]" * 100_000,
        b"1" * 400_000,
    ],
)
def test_a_range_test_file_that_is_not_one_reads_as_none(tmp_path, written):
    (tmp_path / "lr_find.json").write_bytes(written)
    assert read_lr_find(tmp_path) is None


def test_points_that_are_not_numbers_are_left_out(tmp_path):
    written = '{"lr": 0.01, "lrs": [1e-3, "x", 1e-2, 1e-1, true, 2e-1], '
    written += '"losses": [1, 1, null, 0.5, 1, 1e999]}'
    (tmp_path / "lr_find.json").write_text(written)  # 1e999: a float past the range, read as inf
    assert read_lr_find(tmp_path)["points"] == [[1e-3, 1.0], [1e-1, 0.5]]


def test_the_plan_counts_the_range_test(tmp_path):
    told = make_plan(parse_spec(image_spec(tmp_path, max_steps=20), tmp_path))
    auto = make_plan(parse_spec(image_spec(tmp_path, max_steps=20, lr="auto"), tmp_path))
    assert told.lr_find_steps == 0 and auto.lr_find_steps == STEPS
    assert auto.lr_find_s == pytest.approx(STEPS * auto.step_time_s)
    startup_told, startup_auto = told.total_time_s - told.steps_time_s, auto.total_time_s - auto.steps_time_s
    assert startup_auto - auto.lr_find_s == pytest.approx(
        auto.startup_s + auto.evaluation_s
    ) and startup_told == pytest.approx(told.startup_s + told.evaluation_s)
