"""Tiny trained runs in this process, for tests that need a model directory to work on."""

from __future__ import annotations

from pathlib import Path

from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.specs import write_spec


def train_run(tmp_path: Path, raw: dict, name: str) -> Path:
    """Train the spec `raw` into `tmp_path/name`; its model/ directory."""
    spec_path = write_spec(tmp_path / f"{name}.yaml", raw)
    train(load_spec(spec_path), tmp_path / name)
    return tmp_path / name / "model"


def train_text_run(tmp_path: Path, tiny_bert_dir: Path, topics: Path, name: str = "run", **adapt) -> Path:
    """A topics classifier on the tiny BERT, 6 steps, with `adapt` as its adapt section (e.g. lora)."""
    raw = {
        "name": name,
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(topics), "max_length": 32, "eval_fraction": 0.25},
        "train": {"max_steps": 6, "batch_size": 8, "lr": 5e-3, "precision": "fp32"},
        "adapt": adapt,
    }
    return train_run(tmp_path, raw, name)
