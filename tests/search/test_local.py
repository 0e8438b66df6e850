"""`gpuforge tune --local`: real trials (the digits CNN, a few steps each) in processes of their own,
pruned at their evaluations, bounded by a budget, and a search that goes on after its driver is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuforge.search.local import open_search
from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow

JOB = image_spec(Path("."), max_steps=30, eval_every=10, checkpoint_every=10, batch_size=64, lr=3.0e-3)
# the grid's order under seed 4 starts with the good rate: the three hopeless ones after it reach step 10
# far below it, and ASHA (1 in 3 goes on) stops each there
PRUNING = {
    "objective": {"metric": "eval_accuracy"},
    "parameters": {"train.lr": {"choice": [0.02, 1.0e-7, 2.0e-7, 3.0e-7]}},
    "sampler": "grid",
    "seed": 4,
    "pruner": {"asha": {"min_steps": 10, "reduction_factor": 3}},
    "parallel": 1,
}
LONGER = {**JOB, "train": {**JOB["train"], "max_steps": 300, "checkpoint_every": 100}}  # seconds, not 0.3 s


def _spec(tmp_path: Path, tune: dict, job: dict = JOB) -> Path:
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({**job, "tune": tune}))
    return path


def _show(out: Path) -> dict:
    result = run_cli("tune", "show", str(out), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_search_prunes_the_hopeless_trials_at_their_first_rung_and_says_why(tmp_path):
    out = tmp_path / "search"
    result = run_cli("tune", str(_spec(tmp_path, PRUNING, LONGER)), "--local", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["state"] == "finished"
    by_number = {t["number"]: t for t in doc["trials"]}
    assert by_number[0]["params"] == {"train.lr": 0.02}, "the grid's order under seed 4 changed"
    assert by_number[0]["state"] == "finished" and by_number[0]["steps"] == 300
    pruned = [t for t in doc["trials"] if t["state"] == "pruned"]
    assert len(pruned) == 3
    for t in pruned:
        assert t["steps"] < 300  # stopped at the rung (within a poll), not trained to its end
        assert t["reason"].startswith("pruned at step 10: eval_accuracy ")
        assert "is not in the best 1/3 of the" in t["reason"]
        events = (Path(t["run"]) / "events.jsonl").read_text()
        assert '"finished"' not in events and not (Path(t["run"]) / "model").exists()
    assert doc["best"]["trial"] == 0 and doc["best"]["value"] == by_number[0]["value"] > 0.5
    assert doc["best"]["run"] == by_number[0]["run"]
    assert (Path(doc["best"]["run"]) / "model" / "gpuforge.json").exists()
    assert doc["device_hours"] > 0 and doc["counts"] == {"finished": 1, "pruned": 3}
    table = run_cli("tune", "show", str(out))
    assert "best: trial 0, eval_accuracy" in table.stdout and "pruned at step 10" in table.stdout
    # one worker ran the four: the last trained, after two trials dropped mid-run, as a fresh process does
    _, study = open_search(out)
    assert len({t.user_attrs["pid"] for t in study.study.get_trials()}) == 1
    fresh = tmp_path / "fresh"
    assert run_cli("train", str(out / "trials" / "trial-0003.yaml"), "--out", str(fresh)).returncode == 0
    warm, cold = _losses(out / "trials" / "trial-0003"), dict(_losses(fresh))
    assert warm and all(cold[step] == loss for step, loss in warm)


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_budget_reached_mid_search_stops_the_running_trial_at_a_checkpoint_and_starts_no_more(tmp_path):
    job = {
        **JOB,
        "train": {**JOB["train"], "max_steps": 400, "eval_every": 20, "checkpoint_every": 20},
        "cost": {"usd_per_hour": 3600.0},
    }  # fmt: skip  ($1 a device-second)
    tune = {
        "objective": {"metric": "eval_loss"},
        "parameters": {"train.lr": {"loguniform": [1.0e-3, 1.0e-2]}},
        "sampler": "random", "seed": 0, "max_trials": 10, "budget": {"usd": 8.0},
    }  # fmt: skip
    out = tmp_path / "search"
    result = run_cli("tune", str(_spec(tmp_path, tune, job)), "--local", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["state"] == "budget_spent" and len(doc["trials"]) < 10
    if doc["reason"].startswith("spent $"):  # reached while a trial ran: it stopped at a checkpoint
        last = doc["trials"][-1]
        assert last["state"] == "stopped" and last["reason"].startswith(doc["reason"])
        assert doc["spent_usd"] >= 8.0 and doc["budget"]["usd_left"] == 0.0
        # the driver stops a trial within a poll of the budget's end, give or take its checkpoint
        assert doc["spent_usd"] < 8.0 + 6.0
    else:  # what was left would not pay for the cheapest trial so far: none was started
        assert doc["reason"].startswith("what is left of its budget pays for no trial"), doc["reason"]
        cheapest = min(t["cost_usd"] for t in doc["trials"] if t["state"] in ("finished", "pruned"))
        assert 8.0 - doc["spent_usd"] < cheapest


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _evaluations(run: Path) -> int:
    try:
        return sum('"eval_loss"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_a_search_whose_driver_is_killed_goes_on_from_where_it_was_with_no_trial_lost_or_run_twice(tmp_path):
    job = {**JOB, "train": {**JOB["train"], "max_steps": 200, "eval_every": 20, "checkpoint_every": 20}}
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"train.lr": {"loguniform": [1.0e-3, 1.0e-2]}},
        "sampler": "random", "seed": 0, "max_trials": 3, "parallel": 1,
    }  # fmt: skip
    spec, out = _spec(tmp_path, tune, job), tmp_path / "search"
    command = [sys.executable, "-m", "gpuforge", "tune", str(spec), "--local", "--out", str(out)]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = out / "trials" / "trial-0001"
    _wait_for(lambda: _evaluations(second) >= 2, 120, "the second trial's second evaluation")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # the trial hears its driver die (SIGTERM), saves a checkpoint and stops
    _wait_for(lambda: (second / "summary.json").exists(), 60, "the orphaned trial's stop")
    assert json.loads((second / "summary.json").read_text())["status"] in ("cancelled", "paused")
    result = run_cli("tune", str(spec), "--local", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["state"] == "finished"
    assert [t["number"] for t in doc["trials"]] == [0, 1, 2]
    assert all(t["state"] == "finished" and t["steps"] == 200 for t in doc["trials"])
    events = [json.loads(line) for line in (second / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "started"]
    assert len(starts) == 2 and starts[1]["resumed_from"] is not None  # resumed, not started over
    metric_steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert metric_steps == sorted(set(metric_steps))  # each step once
    _, study = open_search(out)
    curve = [s for s, _ in study.trials()[1].curve]
    assert curve == list(range(20, 201, 20))  # each evaluation told to the study once
    assert len(list((out / "trials").glob("trial-*.yaml"))) == 3


def test_tune_stop_ends_a_running_search_with_its_trial_stopped_at_a_checkpoint(tmp_path):
    job = {**JOB, "train": {**JOB["train"], "max_steps": 2000, "eval_every": 20, "checkpoint_every": 100}}
    tune = {"objective": {"metric": "eval_loss"}, "parameters": {"train.lr": {"uniform": [1.0e-3, 1.0e-2]}},
            "max_trials": 5}  # fmt: skip
    spec, out = _spec(tmp_path, tune, job), tmp_path / "search"
    driver = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "tune", str(spec), "--local", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_for(lambda: _evaluations(out / "trials" / "trial-0000") >= 1, 120, "the first evaluation")
    assert run_cli("tune", "stop", str(out)).returncode == 0
    assert driver.wait(timeout=120) == 0
    doc = _show(out)
    assert doc["state"] == "stopped" and [t["state"] for t in doc["trials"]] == ["stopped"]
    assert doc["trials"][0]["value"] is not None  # the figure it had reached


def test_a_folder_holding_another_search_or_none_is_refused(tmp_path):
    out = tmp_path / "search"
    assert "not a search's folder" in run_cli("tune", "show", str(tmp_path)).stderr
    assert "not a search's folder" in run_cli("tune", "stop", str(tmp_path)).stderr
    out.mkdir()
    (out / "search.yaml").write_text(yaml.safe_dump({"tune": {}, "job": {}}))
    result = run_cli("tune", str(_spec(tmp_path, PRUNING)), "--local", "--out", str(out))
    assert result.returncode == 2 and "holds another search" in result.stderr
    assert os.listdir(out) == ["search.yaml"]


def test_trials_run_warm_in_one_worker_alike_a_fresh_train_and_one_that_raises_fails_alone(tmp_path):
    job = {**JOB, "train": {**JOB["train"], "max_steps": 12, "eval_every": 6, "checkpoint_every": 6}}
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"model.options.dropout": {"choice": [0.1, 2.0, 0.0]}},  # 2.0: nn.Dropout raises
        "sampler": "grid", "seed": 0, "max_trials": 3, "parallel": 1,
    }  # fmt: skip
    out = tmp_path / "search"
    result = run_cli("tune", str(_spec(tmp_path, tune, job)), "--local", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    by_dropout = {t["params"]["model.options.dropout"]: t for t in doc["trials"]}
    failed = by_dropout[2.0]
    assert failed["state"] == "failed" and "ValueError" in failed["reason"] and "dropout" in failed["reason"]
    assert "Traceback" in (out / "trials" / f"trial-{failed['number']:04d}.log").read_text()
    assert by_dropout[0.1]["state"] == by_dropout[0.0]["state"] == "finished"
    _, study = open_search(out)
    pids = {t.number: t.user_attrs["pid"] for t in study.study.get_trials()}
    assert len(set(pids.values())) == 1  # one worker ran the three, the failure included
    # the last trial, after two others in that worker, trained as `gpuforge train` does in a fresh process
    last = max(t["number"] for t in doc["trials"] if t["state"] == "finished")
    assert last >= 1
    fresh = tmp_path / "fresh"
    trained = run_cli("train", str(out / "trials" / f"trial-{last:04d}.yaml"), "--out", str(fresh))
    assert trained.returncode == 0, trained.stderr
    assert _losses(out / "trials" / f"trial-{last:04d}") == _losses(fresh)


def test_a_trial_paused_at_a_rung_too_few_have_reached_resumes_once_promoted_with_each_step_once(tmp_path):
    """tune.pruner.asha.pause. The grid's order under seed 42: the good rate, then the second best, then
    four hopeless ones. The second reaches step 10 with only the first there: ASHA alone would prune it
    (the best of 2 goes on); paused, it waits; once six trials are there the best 2 go on, so it resumes
    from its checkpoint and finishes."""
    job = {**JOB, "model": {**JOB["model"], "options": {"sleep_s": 0.05}},  # ~1 s past the rung to pause it
           "train": {**JOB["train"], "max_steps": 29, "eval_every": 10, "checkpoint_every": 10}}  # fmt: skip
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"train.lr": {"choice": [0.02, 0.002, 1.0e-7, 2.0e-7, 3.0e-7, 4.0e-7]}},
        "sampler": "grid", "seed": 42, "parallel": 1,
        "pruner": {"asha": {"min_steps": 10, "reduction_factor": 3, "pause": True}},
    }  # fmt: skip
    out = tmp_path / "search"
    result = run_cli("tune", str(_spec(tmp_path, tune, job)), "--local", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "trial-0001 pauses at step" in result.stdout and "trial-0001 resumes" in result.stdout
    doc = _show(out)
    by_number = {t["number"]: t for t in doc["trials"]}
    assert [by_number[n]["params"]["train.lr"] for n in (0, 1)] == [0.02, 0.002], "the grid's order changed"
    assert by_number[0]["state"] == by_number[1]["state"] == "finished"
    assert by_number[1]["steps"] == 29
    assert [by_number[n]["state"] for n in range(2, 6)] == ["pruned"] * 4
    second = out / "trials" / "trial-0001"
    events = [json.loads(line) for line in (second / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "started"]
    assert len(starts) == 2 and starts[1]["resumed_from"] is not None  # resumed, not started over
    steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 30))  # each step once
    _, study = open_search(out)
    assert [s for s, _ in study.trials()[1].curve] == [10, 20, 29]  # each evaluation told once
