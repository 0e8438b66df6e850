"""A search's study over untrusted metrics lines: whatever a trial writes, reporting skips what is not a
step's figure and never raises; a flood of lines is told a bounded number of evaluations."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from gpuforge.search.study import MAX_REPORTED, SearchStudy
from gpuforge.spec import load_search
from tests.helpers.specs import image_spec


@pytest.fixture
def study(tmp_path) -> SearchStudy:
    tune = {"objective": {"metric": "eval_accuracy"}, "parameters": {"train.lr": {"uniform": [1e-3, 1e-2]}},
            "pruner": {"asha": {"min_steps": 10}}}  # fmt: skip
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({**image_spec(tmp_path, max_steps=100, eval_every=10), "tune": tune}))
    return SearchStudy(load_search(path), f"sqlite:///{tmp_path / 'study.db'}", "search")


def _write(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def test_lines_a_trial_should_not_write_are_skipped_and_never_raise(study, tmp_path):
    number, _ = study.ask()
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [
        '{"step": 10, "eval_accuracy": ' + "9" * 400 + "}",  # an integer no float holds
        {"step": 2**40, "eval_accuracy": 0.5},  # past any real run (and the study's integer column)
        {"step": -3, "eval_accuracy": 0.5},
        {"step": True, "eval_accuracy": 0.5},
        {"step": 20, "eval_accuracy": "high"},
        {"step": 30, "eval_accuracy": False},
        "not json", "[1, 2]", '{"step": 40', "",
        {"step": 50, "eval_accuracy": 0.75},
    ])  # fmt: skip
    taken = study.take_evaluations(number, metrics, 0)
    assert taken.prune is None and taken.offset == metrics.stat().st_size
    assert study.frozen(number).intermediate_values == {50: 0.75}
    assert taken.last_step == 50


def test_a_nan_objective_prunes_its_trial_saying_so(study, tmp_path):
    number, _ = study.ask()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 10, "eval_accuracy": NaN}\n')
    taken = study.take_evaluations(number, metrics, 0)
    assert taken.prune == "pruned at step 10: eval_accuracy is not a number"
    assert math.isnan(study.frozen(number).intermediate_values[10])


def test_a_flood_of_evaluations_is_told_a_bounded_number_at_a_time(study, tmp_path):
    number, _ = study.ask()
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"step": s, "eval_accuracy": 0.5} for s in range(1, 5001)])
    study.take_evaluations(number, metrics, 0)
    told = study.frozen(number).intermediate_values
    assert len(told) == MAX_REPORTED and max(told) == 5000  # the latest ones


def test_a_trial_told_twice_keeps_its_first_end(study):
    number, _ = study.ask()
    study.finish(number, "finished", 0.9, steps=100)
    study.finish(number, "failed", None, reason="late")
    (record,) = study.trials()
    assert (record.state, record.value, record.reason) == ("finished", 0.9, None)
