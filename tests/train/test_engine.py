"""The training loop, in-process, on tiny models: every task, determinism, accumulation, stops, resume."""

import json
import math
import signal

import pytest
import torch
import yaml

from gpuforge.artifact import load_artifact
from gpuforge.errors import ModelError, RunDirError, TrainingFailed
from gpuforge.runs import OPTIONAL_KEYS, RunDir, RunSummary
from gpuforge.spec import parse_spec
from gpuforge.train.engine import train
from tests.helpers.paths import TEST_MODELS
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec

METRIC_FIELDS = {
    "step",
    "loss",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "data_wait_frac",
    "peak_mem_bytes",
    "mfu",
    "cost_usd",
    "eta_s",
}
SUMMARY_FIELDS = {
    "steps",
    "samples_per_s",
    "tokens_per_s",
    "median_step_s",
    "peak_mem_bytes",
    "final_loss",
    "eval",
    "device",
    "precision",
    "batch_size",
    "grad_accum",
    "cost_usd",
    "wall_s",
}


def _train(tmp_path, raw, out="run", reporter=None):
    return train(parse_spec(raw, tmp_path), tmp_path / out, reporter)


def _losses(run_dir):
    return [m["loss"] for m in RunDir(run_dir).metrics()]


def test_image_job_fills_the_run_directory(tmp_path):
    raw = image_spec(tmp_path, max_steps=12, checkpoint_every=5, eval_every=6)
    raw["cost"] = {"usd_per_hour": 3.6}
    summary = _train(tmp_path, raw)
    run = RunDir(tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 12
    assert SUMMARY_FIELDS <= set(summary) and summary["device"] and summary["precision"] in ("fp32", "bf16")
    assert run.summary() == {k: v for k, v in summary.items() if k != "signal"}
    # written through runs.RunSummary: every field, nothing else, no schema_version while it is 1
    always = [k for k in RunSummary.model_fields if k not in OPTIONAL_KEYS][1:]  # energy: where measured
    assert [k for k in json.loads(run.summary_path.read_text()) if k not in OPTIONAL_KEYS] == always
    metrics = run.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(METRIC_FIELDS <= set(m) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert "eval_accuracy" in metrics[5] and "eval_accuracy" in metrics[11] and "eval_loss" not in metrics[4]
    assert all(0 < m["mfu"] < 1 and m["peak_mem_bytes"] > 0 for m in metrics)
    # cost: $3.60/h is $0.001/s; so far grows, per step matches the step time
    assert metrics[-1]["cost_usd"] > metrics[0]["cost_usd"] > 0
    assert math.isclose(metrics[3]["step_cost_usd"], metrics[3]["step_time_s"] * 0.001, rel_tol=1e-9)
    events = [e["event"] for e in run.events()]
    assert events == ["started", "checkpoint", "checkpoint", "checkpoint", "finished"]
    assert [s for s, _ in run.checkpoints()] == [10, 12]  # keep_checkpoints=2 pruned step 5
    assert (run.model_dir / "gpuforge.json").exists() and (run.logs_dir / "train.log").read_text()
    assert "precision" in (run.logs_dir / "train.log").read_text()
    assert run.spec_path.read_text().startswith("name: tiny-digits")


def test_artifact_reloads_with_the_same_predictions(tmp_path):
    _train(tmp_path, image_spec(tmp_path, max_steps=3))
    module, tokenizer, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["format"] == "state_dict" and manifest["labels"] == [str(i) for i in range(10)]
    assert tokenizer is None and manifest["sample_shape"] == [1, 8, 8]
    x = torch.rand(4, 1, 8, 8)
    again, _, _ = load_artifact(tmp_path / "run" / "model")
    assert torch.equal(module(x), again(x))


@pytest.mark.slow
def test_text_classification_on_a_local_transformers_model(tmp_path, tiny_bert_dir, small_topics):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 32},
        "train": {"max_steps": 4, "batch_size": 8, "lr": 1e-3},
    }
    summary = _train(tmp_path, raw)
    assert summary["tokens_per_s"] > 0 and set(summary["eval"]) == {"loss", "accuracy"}
    module, tokenizer, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["format"] == "transformers" and sorted(manifest["labels"]) == manifest["labels"]
    assert module(**tokenizer(["the match went to extra time"], return_tensors="pt")).logits.shape == (1, 4)


def test_plain_torch_text_model_with_the_byte_tokenizer(tmp_path, small_topics):
    raw = {
        "model": {"source": f"python:{TEST_MODELS}:text_model", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "tokenizer": "bytes"},
        "train": {"max_steps": 3, "batch_size": 16, "lr": 1e-2},
    }
    summary = _train(tmp_path, raw)
    assert summary["status"] == "finished" and summary["flops_method"].startswith("measured")


@pytest.mark.slow
def test_causal_lm_from_scratch_reports_perplexity(tmp_path):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    raw = {
        "model": {
            "source": "bundled:gpt-tiny",
            "task": "causal-lm",
            "options": {"n_layer": 1, "n_embd": 32, "n_head": 2},
        },
        "data": {"train": "corpus.txt", "max_length": 32},
        "train": {"max_steps": 5, "batch_size": 8, "lr": 3e-3},
    }
    summary = _train(tmp_path, raw)
    assert summary["tokens_per_s"] > 0 and summary["eval"]["perplexity"] > 1
    assert summary["flops_method"].startswith("6 x")
    _, tokenizer, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["task"] == "causal-lm" and tokenizer.decode(tokenizer("fox")["input_ids"]) == "fox"


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    a = _losses(_train(tmp_path, image_spec(tmp_path, seed=7), "a") and tmp_path / "a")
    b = _losses(_train(tmp_path, image_spec(tmp_path, seed=7), "b") and tmp_path / "b")
    c = _losses(_train(tmp_path, image_spec(tmp_path, seed=8), "c") and tmp_path / "c")
    assert a == b and a != c


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    big = image_spec(tmp_path, batch_size=32, options={"dropout": 0.0})
    accumulated = image_spec(tmp_path, batch_size=16, global_batch_size=32, options={"dropout": 0.0})
    s_big = _train(tmp_path, big, "big")
    s_acc = _train(tmp_path, accumulated, "acc")
    assert (s_acc["batch_size"], s_acc["grad_accum"], s_acc["global_batch_size"]) == (16, 2, 32)
    assert _losses(tmp_path / "acc") == pytest.approx(_losses(tmp_path / "big"), rel=1e-5)
    assert s_big["grad_accum"] == 1


def test_nan_loss_stops_with_a_failed_event_and_keeps_the_last_good_checkpoint(tmp_path):
    raw = image_spec(tmp_path, max_steps=10, checkpoint_every=2, options={"nan_after": 5})
    with pytest.raises(
        TrainingFailed, match="loss is nan at step 6; the last good checkpoint is step-000004"
    ):
        _train(tmp_path, raw)
    run = RunDir(tmp_path / "run")
    failed = run.events()[-1]
    assert failed["event"] == "failed" and "loss is nan" in failed["reason"]
    assert [s for s, _ in run.checkpoints()] == [2, 4]
    assert run.summary()["status"] == "failed" and not run.model_dir.exists()


@pytest.mark.slow
def test_a_spent_budget_pauses_with_a_checkpoint_and_a_higher_one_goes_on(tmp_path):
    raw = image_spec(tmp_path, max_steps=50)
    raw["cost"] = {"usd_per_hour": 1e6, "budget_usd": 0.5}
    summary = _train(tmp_path, raw)
    assert summary["status"] == "paused" and "cost.budget_usd 0.5 spent" in summary["reason"]
    run = RunDir(tmp_path / "run")
    assert run.latest_checkpoint()[0] == summary["steps"] < 50
    paused = run.events()[-1]
    assert paused["event"] == "paused" and paused["budget_usd"] == 0.5 and paused["cost_usd"] >= 0.5
    raw["cost"]["budget_usd"] = 1e9  # the same run directory, a higher budget: it resumes
    assert _train(tmp_path, raw)["status"] == "finished"
    assert [m["step"] for m in run.metrics()] == list(range(1, 51))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_and_a_rerun_resumes_the_same_loss_curve(tmp_path, signum):
    raw = image_spec(tmp_path, max_steps=14, checkpoint_every=5)
    reference = _train(tmp_path, raw, "reference")
    stopped = _train(tmp_path, raw, "run", SignalAt(7, signum))
    assert stopped["status"] == "cancelled" and stopped["signal"] == signum and stopped["steps"] == 7
    run = RunDir(tmp_path / "run")
    assert run.latest_checkpoint()[0] == 7 and not run.model_dir.exists()
    resumed = _train(tmp_path, raw, "run")
    assert resumed["resumed_from"] == 7 and resumed["status"] == "finished"
    assert [m["step"] for m in run.metrics()] == list(range(1, 15))
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "reference"), rel=1e-6)
    assert resumed["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-6)
    assert [e["event"] for e in run.events()].count("started") == 2


def test_a_finished_run_reruns_as_a_no_op_and_extends_with_more_steps(tmp_path):
    raw = image_spec(tmp_path, max_steps=4)
    first = _train(tmp_path, raw)
    events = RunDir(tmp_path / "run").events()
    again = _train(tmp_path, raw)
    assert again == first and RunDir(tmp_path / "run").events() == events  # nothing run, nothing rewritten
    raw["train"]["max_steps"] = 6
    longer = _train(tmp_path, raw)
    assert longer["steps"] == 6 and [m["step"] for m in RunDir(tmp_path / "run").metrics()] == list(
        range(1, 7)
    )


def test_a_run_directory_of_another_spec_is_refused_and_left_alone(tmp_path):
    _train(tmp_path, image_spec(tmp_path, max_steps=2))
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(RunDirError, match=r"different spec \(differs in train.lr\)"):
        _train(tmp_path, image_spec(tmp_path, max_steps=2, lr=0.5))
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_a_run_stored_before_the_tracking_section_existed_still_resumes(tmp_path):
    raw = image_spec(tmp_path, max_steps=2)
    _train(tmp_path, raw)
    stored = RunDir(tmp_path / "run").spec_path
    older = yaml.safe_load(stored.read_text())
    del older["tracking"]  # as an older gpuforge wrote it
    stored.write_text(yaml.safe_dump(older, sort_keys=False))
    raw["train"]["max_steps"] = 3
    assert _train(tmp_path, raw)["steps"] == 3


@pytest.mark.slow
def test_an_fp16_run_checkpoints_its_loss_scale_and_resumes_the_same_loss_curve(tmp_path):
    raw = image_spec(tmp_path, max_steps=8, checkpoint_every=4, precision="fp16")
    _train(tmp_path, raw, "reference")
    assert _train(tmp_path, raw, "run", SignalAt(4))["steps"] == 4
    run = RunDir(tmp_path / "run")
    state = torch.load(run.checkpoint_path(4) / "training_state.pt", weights_only=False)
    assert state["scaler"]["scale"] > 0 and "growth_interval" in state["scaler"]  # the GradScaler's state
    assert _train(tmp_path, raw, "run")["status"] == "finished"
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "reference"), rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_cpu(tmp_path, precision):
    summary = _train(tmp_path, image_spec(tmp_path, max_steps=3, precision=precision))
    assert summary["precision"] == precision and math.isfinite(summary["final_loss"])
    assert "asked for" in summary["precision_reason"]


@pytest.mark.slow
def test_out_of_memory_halves_the_micro_batch_and_keeps_the_loss_curve(tmp_path):
    # the model "runs out of memory" above 16 examples per forward, mid-forward, after dropout drew its mask
    oom = image_spec(tmp_path, max_steps=8, batch_size=64, checkpoint_every=4, options={"oom_above": 16})
    fits = image_spec(tmp_path, max_steps=8, batch_size=16, global_batch_size=64, checkpoint_every=4)
    summary = _train(tmp_path, oom, "oom")
    _train(tmp_path, fits, "fits")
    assert (summary["batch_size"], summary["grad_accum"], summary["global_batch_size"]) == (16, 4, 64)
    run = RunDir(tmp_path / "oom")
    retries = [e for e in run.events() if e["event"] == "retry"]
    assert [(e["step"], e["micro_batch"], e["grad_accum"]) for e in retries] == [(1, 32, 2), (1, 16, 4)]
    assert [m["step"] for m in run.metrics()] == list(range(1, 9))  # no step lost or counted twice
    assert _losses(tmp_path / "oom") == pytest.approx(_losses(tmp_path / "fits"), rel=1e-5)
    assert json.loads((run.checkpoint_path(8) / "meta.json").read_text())["micro_batch"] == 16


def test_a_resumed_run_keeps_the_micro_batch_an_oom_cut(tmp_path):
    raw = image_spec(tmp_path, max_steps=8, batch_size=64, checkpoint_every=2, options={"oom_above": 16})
    _train(tmp_path, raw, "run", SignalAt(3))
    resumed = _train(tmp_path, raw, "run")
    retries = [e for e in RunDir(tmp_path / "run").events() if e["event"] == "retry"]
    assert len(retries) == 2 and resumed["batch_size"] == 16 and resumed["steps"] == 8


def test_out_of_memory_at_a_micro_batch_of_one_fails_cleanly(tmp_path):
    raw = image_spec(tmp_path, max_steps=4, batch_size=4, checkpoint_every=1, options={"oom_above": 0})
    with pytest.raises(TrainingFailed, match="out of memory at step 1 even with a micro-batch of 1"):
        _train(tmp_path, raw)
    assert RunDir(tmp_path / "run").events()[-1]["event"] == "failed"


def test_nan_gradients_under_a_finite_loss_never_reach_the_weights(tmp_path):
    raw = image_spec(tmp_path, max_steps=8, checkpoint_every=1, options={"nan_grad_after": 3})
    with pytest.raises(
        TrainingFailed, match="gradient norm is nan at step 4; the last good checkpoint is step-000003"
    ):
        _train(tmp_path, raw)
    from safetensors.torch import load_file

    weights = load_file(str(RunDir(tmp_path / "run").checkpoint_path(3) / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_steps_logged_before_any_checkpoint_are_not_counted_twice(tmp_path):
    raw = image_spec(tmp_path, max_steps=5)
    spec = parse_spec(raw, tmp_path)
    run = RunDir(tmp_path / "run")
    run.create()
    run.spec_path.write_text(spec.to_yaml())
    for step in (1, 2, 3):  # what a process killed before its first checkpoint leaves behind
        run.metric({"step": step, "loss": 9.0})
    train(spec, run.root)
    assert [m["step"] for m in run.metrics()] == [1, 2, 3, 4, 5] and run.metrics()[0]["loss"] != 9.0


def test_fewer_steps_than_the_run_already_has_is_refused(tmp_path):
    raw = image_spec(tmp_path, max_steps=10)
    _train(tmp_path, raw, "run", SignalAt(6))
    raw["train"]["max_steps"] = 3
    with pytest.raises(RunDirError, match="already at step 6, past the 3 steps asked for"):
        _train(tmp_path, raw)


def test_max_length_beyond_the_model_positions_is_refused_before_writing(
    tmp_path, tiny_bert_dir, small_topics
):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 512},
    }
    with pytest.raises(ModelError, match="data.max_length: 512 is more than the 128 positions"):
        _train(tmp_path, raw)
    assert not (tmp_path / "run").exists()


def test_num_labels_larger_than_the_data_shows_is_kept(tmp_path, tiny_bert_dir, small_topics):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification", "num_labels": 6},
        "data": {"train": str(small_topics), "max_length": 32},
        "train": {"max_steps": 1, "batch_size": 8},
    }
    _train(tmp_path, raw)
    _, _, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["num_labels"] == 6 and manifest["labels"][4:] == ["unseen_4", "unseen_5"]


def test_measuring_the_device_leaves_the_training_rng_alone():
    from gpuforge.hardware.bench import measure_matmul_flops

    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=0.01)
    assert torch.equal(torch.rand(3), expected)


def test_eval_max_examples_samples_the_evaluations_before_the_last(tmp_path):
    whole = _train(tmp_path, image_spec(tmp_path, max_steps=6, eval_every=2), "whole")
    raw = image_spec(tmp_path, max_steps=6, eval_every=2, eval_max_examples=50)
    sampled = _train(tmp_path, raw, "sampled")
    evals = [m for m in RunDir(tmp_path / "sampled").metrics() if "eval_loss" in m]
    assert [(m["step"], m.get("evaluated_examples")) for m in evals] == [(2, 50), (4, 50), (6, None)]
    assert evals[0]["eval_loss"] != next(
        m["eval_loss"] for m in RunDir(tmp_path / "whole").metrics() if m["step"] == 2
    )  # a sample's figure, not the set's
    assert sampled["eval"] == pytest.approx(whole["eval"], rel=1e-6)  # the last: the whole set
    assert _losses(tmp_path / "sampled") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-6)


def test_a_sampled_evaluation_that_ends_the_run_is_followed_by_the_whole_sets(tmp_path):
    stop = {"max_steps": 10, "eval_every": 2, "stop_at": {"eval_accuracy": 0.0}}  # reached at step 2
    whole = _train(tmp_path, image_spec(tmp_path, **stop), "whole")
    sampled = _train(tmp_path, image_spec(tmp_path, eval_max_examples=50, **stop), "sampled")
    assert whole["steps"] == sampled["steps"] == 2
    assert sampled["eval"] == pytest.approx(whole["eval"], rel=1e-6)
    assert [m.get("evaluated_examples") for m in RunDir(tmp_path / "sampled").metrics()] == [None, 50]
