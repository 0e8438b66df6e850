"""train.early_stop, stop_at and keep_best: the decisions over sequences of evaluations (early_stop.py),
and the spec's refusals of rules that could never be judged (spec/jobs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gpuforge.errors import RunDirError, SpecError
from gpuforge.runs import RunDir
from gpuforge.runtime.tasks import EvalTally
from gpuforge.spec import EVAL_METRICS, TASKS, TrainSpec, parse_spec
from gpuforge.train.early_stop import Watch, direction_of
from gpuforge.train.engine import train
from gpuforge.train.resume import check_same_job
from tests.helpers.cli import run_cli
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec, write_spec


def run(watch: Watch, values: list[float], metric: str = "eval_loss", every: int = 10, after: int = 0):
    """Feed `values` one evaluation each `every` steps (the first `after` evaluations done already); the
    (step, decision) list up to the first stop."""
    seen = []
    for i, value in enumerate(values, start=after + 1):
        decision = watch.observe(i * every, {metric: value})
        seen.append((i * every, decision))
        if decision.stop:
            break
    return seen


def test_directions_follow_the_metric_unless_told():
    assert direction_of("eval_loss") == "minimize"
    assert direction_of("eval_perplexity") == "minimize"
    assert direction_of("eval_accuracy") == "maximize"
    assert direction_of("eval_loss", "maximize") == "maximize"


def test_patience_counts_evaluations_without_improvement_past_min_delta():
    watch = Watch("eval_loss", "minimize", min_delta=0.001, patience=3)
    # 0.412 at step 30; 0.4115 is better but not by more than 0.001, so it does not count
    seen = run(watch, [0.9, 0.5, 0.412, 0.4115, 0.43, 0.42])
    assert [step for step, _ in seen] == [10, 20, 30, 40, 50, 60]
    assert [d.best for _, d in seen] == [True, True, True, False, False, False]
    assert seen[-1][1].stop == (
        "stopped early at step 60: eval_loss did not improve by 0.001 for 3 evaluations "
        "(best 0.412 at step 30)"
    )
    assert (watch.state.best, watch.state.best_step, watch.state.bad_evals) == (0.412, 30, 3)


def test_an_improvement_resets_the_count():
    watch = Watch("eval_loss", "minimize", patience=2)
    seen = run(watch, [1.0, 1.1, 0.9, 1.0, 0.95, 0.95])
    assert [d.stop is None for _, d in seen] == [True, True, True, True, False]
    assert seen[-1][1].stop.startswith("stopped early at step 50: eval_loss did not improve for 2")
    assert watch.state.best_step == 30


def test_a_maximized_metric_must_rise():
    watch = Watch("eval_accuracy", "maximize", min_delta=0.01, patience=2)
    seen = run(watch, [0.5, 0.7, 0.705, 0.709, 0.8], metric="eval_accuracy")
    assert seen[-1][0] == 40 and "best 0.7 at step 20" in seen[-1][1].stop


def test_nan_is_never_an_improvement():
    watch = Watch("eval_loss", "minimize", patience=2)
    seen = run(watch, [float("nan"), float("nan")])
    assert seen[-1][1].stop.endswith("for 2 evaluations (no finite value yet)")
    assert watch.state.best is None


def test_stop_at_any_threshold_in_its_own_direction():
    watch = Watch("eval_loss", "minimize", stop_at={"eval_accuracy": 0.9, "eval_loss": 0.2})
    assert watch.observe(10, {"eval_loss": 0.5, "eval_accuracy": 0.8}).stop is None
    assert watch.observe(20, {"eval_loss": 0.3, "eval_accuracy": 0.91}).stop == (
        "reached eval_accuracy 0.91 >= 0.9 at step 20"
    )
    both = Watch("eval_loss", "minimize", stop_at={"eval_accuracy": 0.9, "eval_loss": 0.2})
    assert both.observe(10, {"eval_loss": 0.2, "eval_accuracy": 0.95}).stop == (
        "reached eval_accuracy 0.95 >= 0.9, eval_loss 0.2 <= 0.2 at step 10"
    )


def test_a_goal_met_is_named_before_a_plateau():
    watch = Watch("eval_loss", "minimize", patience=1, stop_at={"eval_accuracy": 0.9})
    watch.observe(10, {"eval_loss": 0.3, "eval_accuracy": 0.8})
    decision = watch.observe(20, {"eval_loss": 0.4, "eval_accuracy": 0.9})
    assert decision.stop == "reached eval_accuracy 0.9 >= 0.9 at step 20"


def test_a_metric_missing_from_the_evaluation_is_an_error():
    with pytest.raises(KeyError, match="eval_accuracy"):
        Watch("eval_accuracy", "maximize", patience=1).observe(10, {"eval_loss": 0.3})


def test_the_state_survives_a_round_trip_and_decides_alike():
    values = [0.9, 0.5, 0.6, 0.55, 0.4, 0.45, 0.5, 0.6, 0.3]
    whole = Watch("eval_loss", "minimize", patience=3)
    uninterrupted = run(whole, values)
    first = Watch("eval_loss", "minimize", patience=3)
    before = run(first, values[:4])
    saved = first.state_dict()  # as a checkpoint's meta.json holds it: two evaluations without improvement
    assert saved["bad_evals"] == 2
    second = Watch("eval_loss", "minimize", patience=3)
    second.load_state_dict(saved)
    after = run(second, values[4:], after=4)
    assert before + after == uninterrupted
    assert uninterrupted[-1][1].stop.startswith("stopped early at step 80")
    fresh = Watch("eval_loss", "minimize", patience=3)
    fresh.load_state_dict(None)  # a checkpoint written before the rules were asked for
    assert fresh.state_dict() == Watch("eval_loss", "minimize").state_dict()


def test_from_spec():
    assert Watch.from_spec(TrainSpec()) is None
    keep = Watch.from_spec(TrainSpec(keep_best=True, eval_every=5))
    assert (keep.metric, keep.direction, keep.patience) == ("eval_loss", "minimize", None)
    early = Watch.from_spec(
        TrainSpec(eval_every=5, early_stop={"metric": "eval_accuracy", "patience": 4, "min_delta": 0.01})
    )
    assert (early.metric, early.direction, early.patience, early.min_delta) == (
        "eval_accuracy",
        "maximize",
        4,
        0.01,
    )
    told = Watch.from_spec(
        TrainSpec(eval_every=5, early_stop={"metric": "eval_loss", "direction": "maximize"})
    )
    assert told.direction == "maximize"


def test_eval_metrics_are_what_the_evaluation_reports():
    for task in TASKS:
        assert EVAL_METRICS[task] == tuple(f"eval_{k}" for k in EvalTally(task).result())


SPEC = {
    "model": {"source": "bundled:tiny", "task": "image-classification"},
    "data": {"train": "sklearn:digits"},
}


def problem(train: dict, data: dict | None = None, task: str = "image-classification") -> str:
    raw = {**SPEC, "model": {**SPEC["model"], "task": task}, "data": {**SPEC["data"], **(data or {})}}
    with pytest.raises(SpecError) as err:
        parse_spec({**raw, "train": train}, Path("."), origin="job.yaml")
    return str(err.value)


@pytest.mark.parametrize("key", ["early_stop", "stop_at", "keep_best"])
def test_refused_without_an_eval_schedule(key):
    value = {"early_stop": {"metric": "eval_loss"}, "stop_at": {"eval_accuracy": 0.9}, "keep_best": True}[key]
    assert problem({key: value}) == (
        f"job.yaml: train.{key}: needs train.eval_every (evaluations during training to judge by); "
        "without it the job evaluates only at its end"
    )


def test_refused_without_an_eval_set():
    msg = problem({"eval_every": 5, "keep_best": True}, data={"eval_fraction": 0})
    assert msg.startswith("job.yaml: train.keep_best: needs an eval set")


def test_refused_for_a_metric_the_evaluation_does_not_report():
    assert problem({"eval_every": 5, "early_stop": {"metric": "eval_acc"}}) == (
        "job.yaml: train.early_stop.metric: eval_acc is not a figure this job's evaluation reports "
        "(a image-classification job's: eval_loss, eval_accuracy)"
    )
    assert "train.stop_at.eval_accuracy: eval_accuracy is not a figure" in problem(
        {"eval_every": 5, "stop_at": {"eval_accuracy": 0.9}}, task="causal-lm"
    )
    assert "train.early_stop.patience: must be >= 1" in problem(
        {"eval_every": 5, "early_stop": {"patience": 0}}
    )


def test_accepted_with_an_eval_schedule():
    spec = parse_spec(
        {**SPEC, "train": {"eval_every": 5, "stop_at": {"eval_accuracy": 0.9}, "keep_best": True}}, Path(".")
    )
    assert spec.train.stop_at == {"eval_accuracy": 0.9} and spec.train.keep_best


# --- real runs: the tiny digits CNN on 12 training examples, which it learns by heart by step 6 or so;
# its eval_loss then rises (the figures below are the run's own, read back from metrics.jsonl) ---------


def overfitting_spec(tmp_path: Path, **train) -> dict:
    return image_spec(tmp_path, lr=0.1, eval_every=2, data={"max_records": 24, "eval_fraction": 0.5}, **train)


def evaluations(run: RunDir) -> list[dict]:
    return [m for m in run.metrics() if "eval_loss" in m]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def patience_reason(evals: list[dict], patience: int, min_delta: float) -> tuple[int, str]:
    """Where early_stop must stop by the run's figures: the first evaluation after which `patience` in a
    row did not beat the best by more than min_delta; (its step, the reason it must give)."""
    best, best_step, bad = math.inf, None, 0
    for record in evals:
        if record["eval_loss"] < best - min_delta:
            best, best_step, bad = record["eval_loss"], record["step"], 0
        else:
            bad += 1
        if bad == patience:
            step = record["step"]
            return step, (
                f"stopped early at step {step}: eval_loss did not improve by {min_delta:g} for {patience} "
                f"evaluations (best {best:.4g} at step {best_step})"
            )
    raise AssertionError(f"the run's evaluations never call for a stop: {evals}")


@pytest.mark.slow
def test_gpuforge_train_stops_early_with_the_reason_and_a_rerun_does_nothing(tmp_path):
    raw = overfitting_spec(
        tmp_path, max_steps=40, early_stop={"metric": "eval_loss", "patience": 3, "min_delta": 0.001}
    )
    spec = write_spec(tmp_path / "spec.yaml", raw)
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    run = RunDir(tmp_path / "run")
    stop_step, reason = patience_reason(evaluations(run), patience=3, min_delta=0.001)
    assert stop_step < 40
    assert reason in result.stdout and f"finished at step {stop_step}/40" in result.stdout
    summary = run.read_summary()
    assert (summary.status, summary.reason, summary.steps) == ("finished", reason, stop_step)
    assert run.events()[-1] == {**run.events()[-1], "event": "finished", "step": stop_step, "reason": reason}
    assert [m["step"] for m in run.metrics()] == list(range(1, stop_step + 1))
    # the model is the last step's (no keep_best), saved although the steps asked for were not all done
    assert same_weights(
        weights(run.model_dir / "model.safetensors"),
        weights(run.checkpoint_path(stop_step) / "model.safetensors"),
    )
    assert json.loads((run.model_dir / "gpuforge.json").read_text())["step"] == stop_step
    events = run.events()
    again = train(parse_spec(raw, tmp_path), tmp_path / "run")  # the checkpoint says it ended: nothing to do
    assert (again["status"], again["reason"], again["steps"]) == ("finished", reason, stop_step)
    assert run.events() == events


@pytest.mark.slow
def test_gpuforge_train_keeps_the_best_evaluations_model(tmp_path):
    raw = overfitting_spec(tmp_path, max_steps=16, keep_best=True, checkpoint_every=2, keep_checkpoints=8)
    result = run_cli("train", str(write_spec(tmp_path / "spec.yaml", raw)), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    run = RunDir(tmp_path / "run")
    evals = evaluations(run)
    best = min(evals, key=lambda m: m["eval_loss"])  # the first of equals, as keep_best keeps it
    assert best["step"] < 16, evals  # overfitted: the last step's model is not the best
    reason = f"model kept from step {best['step']} (best eval_loss {best['eval_loss']:.4g})"
    summary = run.read_summary()
    assert (summary.status, summary.steps, summary.reason) == ("finished", 16, reason)
    assert reason in result.stdout and run.events()[-1]["reason"] == reason
    assert summary.eval == {"loss": best["eval_loss"], "accuracy": best["eval_accuracy"]}
    model = weights(run.model_dir / "model.safetensors")
    assert same_weights(model, weights(run.checkpoint_path(best["step"]) / "model.safetensors"))
    assert not same_weights(model, weights(run.checkpoint_path(16) / "model.safetensors"))
    assert json.loads((run.model_dir / "gpuforge.json").read_text())["step"] == best["step"]
    # the checkpoints name the best: no other copy is kept
    assert [p.name for p in run.checkpoints_dir.glob("best-*")] == [
        f"best-step-{best['step']:06d}.safetensors"
    ]


@pytest.mark.slow
def test_a_resumed_run_stops_and_keeps_the_best_as_one_that_never_stopped(tmp_path):
    raw = overfitting_spec(
        tmp_path, max_steps=40, checkpoint_every=4, keep_best=True,
        early_stop={"metric": "eval_loss", "patience": 3, "min_delta": 0.001},
    )  # fmt: skip
    spec = parse_spec(raw, tmp_path)
    reference = train(spec, tmp_path / "reference")
    stop_step, reason = patience_reason(evaluations(RunDir(tmp_path / "reference")), 3, 0.001)
    assert reference["steps"] == stop_step and reference["reason"].startswith(reason + "; model kept")
    assert stop_step > 9  # the signal below comes between the best and the stop
    stopped = train(spec, tmp_path / "run", SignalAt(9))
    assert (stopped["status"], stopped["steps"]) == ("cancelled", 9)
    meta = json.loads((RunDir(tmp_path / "run").checkpoint_path(9) / "meta.json").read_text())
    assert meta["early_stop"]["best_step"] is not None and meta["early_stop"]["stopped"] is None
    # as a process killed after a new best at step 10 but before a checkpoint recorded it would leave it
    best_files = RunDir(tmp_path / "run").checkpoints_dir
    (best_files / "best-step-000010.safetensors").write_bytes(b"not what step 10 of this run makes")
    resumed = train(spec, tmp_path / "run")
    assert resumed["resumed_from"] == 9
    for key in ("status", "reason", "steps", "eval"):
        assert resumed[key] == reference[key], key
    evals = [
        {k: v for k, v in m.items() if k.startswith("eval_") or k == "step"}
        for m in evaluations(RunDir(tmp_path / "run"))
    ]
    assert evals == [
        {k: v for k, v in m.items() if k.startswith("eval_") or k == "step"}
        for m in evaluations(RunDir(tmp_path / "reference"))
    ]
    assert same_weights(
        weights(tmp_path / "run" / "model" / "model.safetensors"),
        weights(tmp_path / "reference" / "model" / "model.safetensors"),
    )
    reference_best = RunDir(tmp_path / "reference").checkpoints_dir.glob("best-*")
    assert [p.name for p in best_files.glob("best-*")] == [p.name for p in reference_best]


@pytest.mark.slow
def test_stop_at_ends_the_job_once_a_threshold_is_reached(tmp_path):
    raw = overfitting_spec(tmp_path, max_steps=40, stop_at={"eval_accuracy": 0.4})
    summary = train(parse_spec(raw, tmp_path), tmp_path / "run")
    evals = evaluations(RunDir(tmp_path / "run"))
    first = next(m for m in evals if m["eval_accuracy"] >= 0.4)
    assert evals[-1]["step"] == first["step"] < 40
    reason = f"reached eval_accuracy {first['eval_accuracy']:.4g} >= 0.4 at step {first['step']}"
    assert (summary["status"], summary["reason"], summary["steps"]) == ("finished", reason, first["step"])
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()


def test_a_run_stored_before_the_keys_existed_resumes_and_a_changed_rule_is_refused(tmp_path):
    spec = parse_spec({**SPEC, "train": {"max_steps": 4}}, tmp_path)
    run = RunDir(tmp_path / "run")
    run.create()
    stored = spec.model_dump(mode="json")
    for key in ("early_stop", "stop_at", "keep_best"):
        del stored["train"][key]  # as an older gpuforge wrote it
    run.spec_path.write_text(yaml.safe_dump(stored, sort_keys=False))
    check_same_job(run, spec)
    with pytest.raises(RunDirError, match=r"differs in train\.eval_every, train\.keep_best\)"):
        check_same_job(
            run, parse_spec({**SPEC, "train": {"max_steps": 4, "eval_every": 2, "keep_best": True}}, tmp_path)
        )
