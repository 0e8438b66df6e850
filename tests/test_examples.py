"""Every shipped example spec loads, runs for a few steps, and says nothing but its own lines."""

import json
from pathlib import Path

import pytest

from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.cli import run_cli
from tests.helpers.output import OWN_LINE

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples_for_each_task():
    tasks = {load_spec(p).model.task for p in EXAMPLES}
    assert tasks == {"image-classification", "sequence-classification", "causal-lm"}


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_a_few_steps(tmp_path, path):
    spec = load_spec(path, ["train.max_steps=2", "data.max_records=200"])
    summary = train(spec, tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert (tmp_path / "run" / "model" / "gpuforge.json").exists()


# a quick run of each example: one step, a few records, one recovery step after pruning
QUICK = ["--max-steps", "1", "--set", "data.max_records=200"]
QUICKER = {"digits-cnn": ["--set", "compress.prune.recover_steps=1"]}


def _not_own(result) -> list[str]:
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if line.strip() and not OWN_LINE.fullmatch(line.rstrip())]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_a_plain_train_of_each_example_prints_nothing_but_gpuforges_own_lines(tmp_path, path):
    run = tmp_path / "run"
    result = run_cli("train", str(path), "--out", str(run), *QUICK, *QUICKER.get(path.stem, []))
    assert result.returncode == 0, result.stderr
    assert _not_own(result) == []
    assert "finished at step 1/1" in result.stdout
    manifest = json.loads((run / "model" / "gpuforge.json").read_text())
    if manifest["kind"] == "adapter" and manifest["task"] == "sequence-classification":
        assert manifest["modules_to_save"] == ["classifier"]  # the head once, not PEFT's guesses too


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--verbose", "GPUFORGE_VERBOSE=1"])
def test_verbose_shows_the_third_party_output_again(tmp_path, how):
    spec = EXAMPLES[0].parent / "minilm-topics.yaml"
    flag, env = ([how], None) if how.startswith("--") else ([], dict([how.split("=")]))
    result = run_cli(*flag, "train", str(spec), "--out", str(tmp_path / "run"), *QUICK, env=env)
    assert result.returncode == 0, result.stderr
    assert _not_own(result) != []  # transformers, at least, says the new classification head is untrained
