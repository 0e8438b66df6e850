"""A search's plan: its trials times one trial's plan, times the share of a trial's steps its pruner is
expected to leave, capped by its budget."""

import json

import pytest
import yaml

from gpuforge.plan.search import expected_step_share, plan_search
from gpuforge.spec import load_search
from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec


def _search(tmp_path, tune: dict, **train):
    path = tmp_path / "search.yaml"
    job = image_spec(tmp_path, **{"max_steps": 180, "eval_every": 20, **train})
    searched = {"train.lr": {"uniform": [1e-3, 1e-2]}}
    tune = {"objective": {"metric": "eval_accuracy"}, "parameters": searched, **tune}
    path.write_text(yaml.safe_dump({**job, "tune": tune}))
    return load_search(path)


def test_asha_leaves_each_rung_one_trial_in_its_reduction_factor(tmp_path):
    search = _search(tmp_path, {"pruner": {"asha": {"min_steps": 20, "reduction_factor": 3}}})
    # rungs at 20 and 60 (180 is the end): 20 steps for all, 40 for a third, 120 for a ninth
    assert expected_step_share(search, 180) == pytest.approx((20 + 40 / 3 + 120 / 9) / 180)
    assert expected_step_share(_search(tmp_path, {"pruner": "none"}), 180) == 1.0


def test_the_range_pays_each_trials_start_up_and_stops_at_the_budget(tmp_path):
    search = _search(
        tmp_path, {"pruner": {"asha": {"min_steps": 20}}, "max_trials": 10, "budget": {"usd": 0.5}}
    )
    share = expected_step_share(search, 180)
    planned = plan_search(search, trial_time_s=100.0, startup_s=10.0, usd_per_hour=36.0, total_steps=180)
    assert planned.low_time_s == pytest.approx(10 * (10 + 90 * share))
    assert planned.high_time_s == 1000.0 and planned.trial_cost_usd == pytest.approx(1.0)
    assert planned.high_usd == 0.5 and planned.low_usd <= 0.5  # the budget caps both ends
    assert planned.line().endswith("; its budget stops it at $0.5")


@pytest.mark.slow
def test_gpuforge_plan_on_a_search_spec_prints_one_trials_plan_and_the_searchs_range(tmp_path):
    _search(tmp_path, {"pruner": {"asha": {"min_steps": 20}}, "max_trials": 4})
    result = run_cli("plan", str(tmp_path / "search.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    assert planned["search"]["trials"] == 4 and planned["trial"]["total_steps"] == 180
    assert planned["search"]["low_time_s"] < planned["search"]["high_time_s"]
    assert planned["search"]["high_time_s"] == pytest.approx(4 * planned["trial"]["total_time_s"])
