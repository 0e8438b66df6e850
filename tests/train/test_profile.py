"""Profiles of real training runs on this CPU (train.profile, `gpuforge train --profile`, `gpuforge profile`):
the step split into the phases gpuforge marks, the trace, the top operators, advice on a run built to need
it, and nothing at all when no profile is asked for."""

import gzip
import json
from pathlib import Path

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
    train_run(tmp_path, _cnn_spec(tmp_path, max_steps=10, profile={"start_step": 4, "steps": 3}), "run")
    report = _profile(tmp_path / "run")
    assert [s["step"] for s in report["steps"]] == [4, 5, 6] and not report["cut_short"]
    parts = report["breakdown"]
    marked = sum(p["seconds"] for name, p in parts.items() if name != "other")
    # the marked phases (data wait, forward, backward, optimizer, logging, ...) are the step, within 10 %
    assert abs(marked - report["mean_step_s"]) <= 0.1 * report["mean_step_s"], parts
    assert abs(sum(p["share"] for p in parts.values()) - 1) < 1e-6
    assert (
        parts["forward"]["seconds"] > 0
        and parts["backward"]["seconds"] > 0
        and parts["optimizer"]["seconds"] > 0
    )
    assert report["top_operators"][0]["name"].startswith("aten::") and report["all_reduce"] is None
    assert report["context"]["trainable_params"] > 0 and report["context"]["lora"] is False

    with gzip.open(tmp_path / "run" / "profile" / "trace.json.gz", "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"gpuforge.step", "gpuforge.forward", "gpuforge.backward", "gpuforge.optimizer"} <= names


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


def test_evaluating_every_step_is_advised_against_and_the_cli_prints_the_breakdown(tmp_path):
    spec = image_spec(tmp_path, max_steps=6, eval_every=1, data={"eval_fraction": 0.6}, batch_size=8)
    run = tmp_path / "run"
    result = run_cli(
        "train", str(write_spec(tmp_path / "job.yaml", spec)), "--out", str(run), "--profile", "2:3"
    )
    assert result.returncode == 0, result.stderr
    report = _profile(run)
    assert report["breakdown"]["evaluation"]["share"] > 0.25
    assert any("train.eval_every" in line for line in report["advice"]), report["advice"]

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


def test_a_window_outside_the_run_is_said_and_a_profiled_run_resumes_with_another_window(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=4, checkpoint_every=2))
    run = tmp_path / "run"
    outside = run_cli("train", str(spec), "--out", str(run), "--profile", "50:3")
    assert outside.returncode == 0 and "steps 50 to 52 are not among this run's (1 to 4)" in outside.stderr
    assert not (run / "profile").exists()
    resumed = run_cli("train", str(spec), "--out", str(run), "--max-steps", "8", "--profile", "6:2")
    assert resumed.returncode == 0, resumed.stderr  # train.profile may change on a resume
    assert [s["step"] for s in _profile(run)["steps"]] == [6, 7]


def test_each_ddp_rank_writes_its_trace_and_rank_0_measures_the_all_reduce(tmp_path):
    from tests.helpers.ddp_specs import write_ddp_spec

    spec = write_ddp_spec(tmp_path, "ddp", train={"max_steps": 8, "profile": {"start_step": 3, "steps": 3}})
    run = tmp_path / "run"
    result = run_cli("train", str(spec), "--out", str(run))
    assert result.returncode == 0, result.stderr
    written = {p.name for p in (run / "profile").iterdir()}
    assert written == {"profile.json", "trace.json.gz", "profile.rank1.json", "trace.rank1.json.gz"}
    report = _profile(run)
    comm = report["all_reduce"]  # gloo's own ranges: DDP's gradient buckets and the step's figures
    assert comm["bytes"] > 0 and comm["seconds"] > 0 and comm["bandwidth_bytes_per_s"] > 0
    assert report["breakdown"]["sync"]["seconds"] > 0 and report["context"]["processes"] == 2

    slowest = read_profile(run)["slowest_rank"]  # rank 1's breakdown, where it was the slower
    assert slowest["ranks"] == 2 and slowest["rank"] in (0, 1)
    rank1 = json.loads((run / "profile" / "profile.rank1.json").read_text())
    rank1["mean_step_s"] = report["mean_step_s"] * 3  # as a rank on a throttled device would be
    (run / "profile" / "profile.rank1.json").write_text(json.dumps(rank1))
    shown = run_cli("profile", str(run))
    assert shown.returncode == 0 and "the slowest rank, 1: mean step" in shown.stdout, shown.stdout
    assert read_profile(run)["slowest_rank"]["trace"] == "trace.rank1.json.gz"
