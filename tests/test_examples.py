"""Every shipped example spec loads, and runs for a few steps."""

from pathlib import Path

import pytest

from gpuforge.spec import load_spec
from gpuforge.train.engine import train

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples_for_each_task():
    tasks = {load_spec(p).model.task for p in EXAMPLES}
    assert tasks == {"image-classification", "sequence-classification", "causal-lm"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_a_few_steps(tmp_path, path):
    spec = load_spec(path, ["train.max_steps=2", "data.max_records=400"])
    summary = train(spec, tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert (tmp_path / "run" / "model" / "gpuforge.json").exists()
