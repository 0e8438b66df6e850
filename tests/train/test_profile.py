"""Profiles of real training runs on this CPU (train.profile, `gpuforge train --profile`, `gpuforge profile`):
the step split into the phases gpuforge marks, the trace, the top operators, advice on a run built to need
it, and nothing at all when no profile is asked for."""

import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from gpuforge.profile_files import read_profile
from gpuforge.runtime import phases
from tests.helpers.cli import run_cli
from tests.helpers.runs import train_run
from tests.helpers.specs import image_spec, write_spec

CNN = Path(__file__).resolve().parents[2] / "examples" / "models" / "digits_cnn.py"


def _cnn_spec(tmp_path: Path, **train) -> dict:
    spec = image_spec(tmp_path, **train)
    spec["model"] = {
        "source": f"python:{CNN}:build",
        "task": "image-classification",
        "options": {"channels": 32},
    }
    return spec


def _profile(run: Path) -> dict:
    return json.loads((run / "profile" / "profile.json").read_text())


def test_a_profiled_step_is_split_into_phases_that_cover_it_with_its_trace_and_operators(tmp_path):
    train_run(tmp_path, _cnn_spec(tmp_path, max_steps=14, profile={"start_step": 4, "steps": 8}), "run")
    report = _profile(tmp_path / "run")
    assert [s["step"] for s in report["steps"]] == list(range(4, 12)) and not report["cut_short"]
    parts = report["breakdown"]
    # the marked phases (data wait, forward, backward, optimizer, logging, ...) are the step, within 10 %,
    # in the median step: a phase left unmarked leaves a gap in every step, while the other test worker
    # taking this core leaves one in a step or two (measured under two busy processes: 0.4 ms of 11-15 ms
    # steps unmarked, 4.5 ms in the one step preempted between two phases)
    uncovered = sorted(1 - sum(s["phases"].values()) / s["seconds"] for s in report["steps"])
    assert uncovered[len(uncovered) // 2] <= 0.1, report["steps"]
    assert abs(sum(p["share"] for p in parts.values()) - 1) < 1e-6
    assert (
        parts["forward"]["seconds"] > 0
        and parts["backward"]["seconds"] > 0
        and parts["optimizer"]["seconds"] > 0
    )
    assert report["top_operators"][0]["name"].startswith("aten::") and report["all_reduce"] is None
    assert report["context"]["trainable_params"] > 0 and report["context"]["lora"] is False

    with gzip.open(tmp_path / "run" / "profile" / "trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"gpuforge.step", "gpuforge.forward", "gpuforge.backward", "gpuforge.optimizer"} <= names
    assert not any(e.get("cat") == "python_function" for e in events)  # stacks are asked for, not default


def test_no_profile_asked_for_creates_nothing_and_the_phase_markers_do_nothing(tmp_path):
    train_run(tmp_path, image_spec(tmp_path, max_steps=3), "run")
    assert not (tmp_path / "run" / "profile").exists()
    assert phases._clock is None and phases.phase("forward") is phases.phase("backward")  # one shared no-op


def test_a_slow_forward_is_the_top_share_and_a_run_ending_inside_the_window_keeps_what_it_recorded(tmp_path):
    spec = image_spec(tmp_path, max_steps=4, profile={"start_step": 3, "steps": 5}, options={"sleep_s": 0.25})
    train_run(tmp_path, spec, "run")
    report = _profile(tmp_path / "run")
    assert report["cut_short"] and [s["step"] for s in report["steps"]] == [3, 4]
    first = report["steps"][0]  # the last step also evaluates the model: its own top share
    top = max(first["phases"].items(), key=lambda kv: kv[1])
    assert top[0] == "forward" and top[1] >= 0.25, first  # the forward's sleep is in it, not elsewhere


@pytest.mark.slow
def test_evaluating_every_step_is_advised_against_and_the_cli_prints_the_breakdown(tmp_path):
    # an eval set of about 180 digits (23 batches of 8: evaluation takes 4x the micro-batch) against one
    # training batch of 2: the evaluation is most of each step; a larger set (it was 1,078) only made the
    # Python stacks the profile records longer
    spec = image_spec(tmp_path, max_steps=6, eval_every=1, data={"eval_fraction": 0.1}, batch_size=2)
    run = tmp_path / "run"
    result = run_cli(
        "train", str(write_spec(tmp_path / "job.yaml", spec)), "--out", str(run), "--profile", "2:3",
        "--set", "train.profile.stacks=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = _profile(run)
    assert report["breakdown"]["evaluation"]["share"] > 0.25
    assert any("train.eval_every" in line for line in report["advice"]), report["advice"]
    with gzip.open(run / "profile" / "trace.json.gz", "rt") as f:  # Python stacks, asked for
        python = {e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "python_function"}
    assert any(name.startswith("gpuforge/train/step.py(") for name in python), sorted(python)[:20]
    assert not any(".py(" in row["name"] for row in report["top_operators"])  # frames are no operators

    shown = run_cli("profile", str(run))
    assert shown.returncode == 0, shown.stderr
    assert "mean step" in shown.stdout and "evaluation" in shown.stdout and "aten::" in shown.stdout
    assert "advice: evaluation" in shown.stdout and "train.eval_every" in shown.stdout


# many parameters and little work for each: a wide MLP on 1 example a step, whose AdamW update over 4.3 M
# parameters is most of the step (75 % here)
WIDE = """
from torch import nn

def build(num_labels: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(),
                         nn.Linear(2048, num_labels))
"""


def test_an_optimizer_bound_run_is_advised_lora(tmp_path):
    (tmp_path / "wide.py").write_text(WIDE)
    spec = image_spec(tmp_path, max_steps=8, batch_size=1, profile={"start_step": 4, "steps": 3})
    spec["model"] = {"source": f"python:{tmp_path / 'wide.py'}:build", "task": "image-classification"}
    train_run(tmp_path, spec, "run")
    report = _profile(tmp_path / "run")
    assert report["breakdown"]["optimizer"]["share"] >= 0.25, report["breakdown"]
    line = next(line for line in report["advice"] if line.startswith("optimizer"))
    assert "4.3 M trainable parameters: model.lora" in line, report["advice"]


HEADS = """
from torch import nn


class DocumentHead(nn.Module):  # a document by its first 16 tokens: the rest is carried for nothing
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, num_labels)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids[:, :16]).mean(1))


def build(vocab_size, num_labels):
    return DocumentHead(vocab_size, num_labels)
"""


@pytest.mark.slow
def test_a_run_waiting_on_its_batches_shows_data_wait_on_top_and_is_advised_a_shorter_max_length(tmp_path):
    """Long documents (about 18 kB each) padded into batches of 128 at data.max_length 16384, for a model
    that reads their first 16 tokens: building the batches is most of the step."""
    (tmp_path / "heads.py").write_text(HEADS)
    rng = random.Random(0)
    words = (["alpha", "beta", "gamma", "delta"], ["omega", "sigma", "kappa", "theta"])
    with (tmp_path / "long.jsonl").open("w") as f:
        for i in range(256):
            text = " ".join(rng.choice(words[i % 2]) for _ in range(3000))
            f.write(json.dumps({"text": text, "label": i % 2}) + "\n")
    spec = {
        "model": {"source": f"python:{tmp_path / 'heads.py'}:build", "task": "sequence-classification"},
        "data": {"train": str(tmp_path / "long.jsonl"), "tokenizer": "bytes", "max_length": 16384},
        # 20 steps recorded: a stall of this shared machine in one of them does not reorder the mean step
        "train": {"max_steps": 26, "batch_size": 128, "lr": 1e-2, "precision": "fp32", "log_every": 1,
                  "profile": {"start_step": 4, "steps": 20}},
    }  # fmt: skip
    # one thread: on two, this tiny model's ops waited on the core the other test worker held (forward and
    # backward 5-50 ms a step instead of 0.6 ms, which put backward on top in a CI run)
    torch.set_num_threads(1)
    train_run(tmp_path, spec, "run")
    parts = _profile(tmp_path / "run")["breakdown"]
    assert max(parts, key=lambda part: parts[part]["share"]) == "data_wait", parts
    assert parts["data_wait"]["share"] >= 0.30, parts
    advice = _profile(tmp_path / "run")["advice"]
    assert any(line.startswith("data wait") and "data.max_length" in line for line in advice), advice


@pytest.mark.slow
def test_bad_profile_requests_say_what_is_wrong(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=2))
    bad = run_cli("train", str(spec), "--out", str(tmp_path / "r"), "--profile", "ten")
    assert bad.returncode == 2 and "expected START:STEPS" in bad.stderr
    too_many = run_cli("train", str(spec), "--out", str(tmp_path / "r"), "--profile", "1:500")
    assert too_many.returncode == 2 and "train.profile.steps" in too_many.stderr
    script = write_spec(tmp_path / "script.yaml", {"name": "s", "kind": "script", "script": {"command": "x"}})
    refused = run_cli("train", str(script), "--profile", "1:2")
    assert refused.returncode == 2 and "a script job runs its own loop" in refused.stderr
    missing = run_cli("profile", str(tmp_path))
    assert missing.returncode == 2 and "train with --profile" in missing.stderr
    (tmp_path / "profile").mkdir()
    for text in ("{not json", '{"breakdown": {}}', '{"breakdown": {"forward": 1}, "mean_step_s": 1}'):
        (tmp_path / "profile" / "profile.json").write_text(text)
        broken = run_cli("profile", str(tmp_path))
        assert broken.returncode == 2 and "not a profile gpuforge wrote" in broken.stderr, broken.stderr


@pytest.mark.slow
def test_a_window_outside_the_run_is_said_and_a_profiled_run_resumes_with_another_window(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=4, checkpoint_every=2))
    run = tmp_path / "run"
    outside = run_cli("train", str(spec), "--out", str(run), "--profile", "50:3")
    assert outside.returncode == 0 and "steps 50 to 52 are not among this run's (1 to 4)" in outside.stderr
    assert not (run / "profile").exists()
    resumed = run_cli("train", str(spec), "--out", str(run), "--max-steps", "8", "--profile", "6:2")
    assert resumed.returncode == 0, resumed.stderr  # train.profile may change on a resume
    assert [s["step"] for s in _profile(run)["steps"]] == [6, 7]


# the digits MLP, whose rank 1 is slower: as a rank on a slower device, each of its forwards takes 30 ms more
SLOW_RANK_1 = """
import os, time
from torch import nn

class Uneven(nn.Module):
    def __init__(self, num_labels):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, num_labels))

    def forward(self, x):
        if self.training and os.environ.get("RANK") == "1":
            time.sleep(0.03)
        return self.net(x)

def build(num_labels: int) -> nn.Module:
    return Uneven(num_labels)
"""


@pytest.mark.slow
def test_each_ddp_rank_writes_its_trace_and_rank_0_measures_the_all_reduce(tmp_path):
    from tests.helpers.ddp_specs import write_ddp_spec

    (tmp_path / "uneven.py").write_text(SLOW_RANK_1)
    model = {"source": "python:uneven.py:build"}
    train = {"max_steps": 8, "profile": {"start_step": 3, "steps": 3}}
    spec = write_ddp_spec(tmp_path, "ddp", train=train, model=model)
    run = tmp_path / "run"
    result = run_cli("train", str(spec), "--out", str(run))
    assert result.returncode == 0, result.stderr
    written = {p.name for p in (run / "profile").iterdir()}
    assert written == {"profile.json", "trace.json.gz", "profile.rank1.json", "trace.rank1.json.gz"}
    report = _profile(run)
    comm = report["all_reduce"]  # gloo's own ranges: DDP's gradient buckets and the step's figures
    assert comm["bytes"] > 0 and comm["seconds"] > 0 and comm["bandwidth_bytes_per_s"] > 0
    assert report["breakdown"]["sync"]["seconds"] > 0 and report["context"]["processes"] == 2

    # both ranks' steps last as long (each waits for the other); rank 0 spends rank 1's sleep waiting
    slowest = read_profile(run)["slowest_rank"]
    assert (slowest["ranks"], slowest["rank"], slowest["trace"]) == (2, 1, "trace.rank1.json.gz"), slowest
    assert slowest["busy_s"] >= 0.03 and slowest["breakdown"]["forward"]["seconds"] >= 0.03
    shown = run_cli("profile", str(run))
    assert shown.returncode == 0 and "the slowest rank, 1:" in shown.stdout, shown.stdout


def test_an_asked_window_goes_before_train_profiles_and_a_request_waits_while_one_records(
    tmp_path, monkeypatch
):
    """The engine's Profiling over real torch.profiler windows around a small matmul step."""
    import torch

    from gpuforge.profile_files import REQUEST_FILE, ask
    from gpuforge.train import profile
    from gpuforge.train.profile import Profiling, StepProfiler

    monkeypatch.setattr(profile, "REQUEST_LOOK_S", 0.0)  # a look every step: the steps here take no time

    events = []
    folder, cpu = tmp_path / "profile", torch.device("cpu")

    def window(first: int, count: int) -> StepProfiler:
        return StepProfiler(first, count, folder, cpu, 0, {}, lambda **e: events.append(e))

    profiling = Profiling(window(10, 2), window, tmp_path)  # train.profile: steps 10 and 11
    ask(tmp_path, 3)
    for step in range(1, 13):
        asked = profiling.asked()
        with profiling.step(step):
            torch.ones(64, 64) @ torch.ones(64, 64)
        if step == 3:
            ask(tmp_path, 2)  # while steps 2 to 4 record: it waits, untaken
            assert profiling.asked() == 0 and (tmp_path / REQUEST_FILE).exists()
        if asked:
            profiling.open(step + 1, asked, last_step=12)
    # the first request's window, the second's once the first was written, then train.profile's
    assert [(e["start_step"], e["steps"]) for e in events] == [(2, 3), (6, 2), (10, 2)]
    assert not (tmp_path / REQUEST_FILE).exists()
    assert [s["step"] for s in _profile(tmp_path)["steps"]] == [10, 11]
