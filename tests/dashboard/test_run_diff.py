"""Comparing runs: ids parsed with their errors, only the differing spec keys, final figures."""

import pytest

from gpuforge.dashboard.run_diff import finals, flatten, parse_ids, spec_diff


def test_ids_are_two_to_eight_distinct_job_ids():
    assert parse_ids("3, 5,8,5") == [3, 5, 8]
    for bad, message in [("3", "2 to 8"), ("1,2,3,4,5,6,7,8,9", "2 to 8"), ("3,x", "'x' is not a job id")]:
        with pytest.raises(ValueError, match=message):
            parse_ids(bad)


def test_only_the_keys_that_differ_in_the_order_they_appear():
    a = {"name": "a", "train": {"lr": 0.01, "steps": 5}, "model": {"options": {}}}
    b = {"name": "b", "train": {"lr": 0.02, "steps": 5, "seed": 1}, "model": {"options": {}}}
    assert flatten(a) == {"name": "a", "train.lr": 0.01, "train.steps": 5, "model.options": {}}
    assert spec_diff([a, b]) == [
        {"key": "name", "values": ["a", "b"]},
        {"key": "train.lr", "values": [0.01, 0.02]},
        {"key": "train.seed", "values": [None, 1]},
    ]


def test_final_figures_from_the_summary_else_the_latest():
    summary = {"status": "finished", "eval": {"accuracy": 0.9}, "final_loss": 0.1, "samples_per_s": 50.0}
    assert finals(3, summary, {"loss": 0.5, "mfu": 0.2})["final_loss"] == 0.1
    running = finals(4, None, {"loss": 0.5, "mfu": 0.2})
    assert running == {"id": 4, "status": None, "eval": {}, "final_loss": 0.5, "samples_per_s": None,
                       "mfu": 0.2, "cost_usd": None, "wall_s": None}  # fmt: skip
