"""Fixtures the serving tests share."""

import pytest

from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.paths import TOPICS
from tests.helpers.specs import write_spec


def _adapter(tmp, tiny_bert_dir, topics, name, seed):
    raw = {
        "name": name,
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(topics), "max_length": 16, "eval_fraction": 0.25},
        "train": {"max_steps": 4, "batch_size": 8, "lr": 2e-2, "precision": "fp32", "seed": seed},
        "adapt": {"lora": {"r": 4}},
    }
    train(load_spec(write_spec(tmp / f"{name}.yaml", raw)), tmp / name)
    return tmp / name / "model"


@pytest.fixture(scope="module")
def three_adapters(tmp_path_factory, tiny_bert_dir):
    """The model/ directories of three LoRA runs on the tiny BERT (own, b, c; seconds each), all in one
    folder: <folder>/<name>/model."""
    tmp = tmp_path_factory.mktemp("serve-adapters")
    topics = tmp / "topics.jsonl"
    topics.write_text("\n".join(TOPICS.read_text().splitlines()[:96]) + "\n")
    return [_adapter(tmp, tiny_bert_dir, topics, name, seed) for seed, name in enumerate(("own", "b", "c"))]
