"""Tiny trained runs the serving tests share, seconds each: a topics classifier on a 2-layer, 32-wide BERT
(conftest's tiny_bert_dir), a 2-layer, 32-wide GPT (bundled:gpt-tiny) on a few lines of code, and the
digits example's CNN."""

from pathlib import Path

from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.paths import ROOT, TOPICS
from tests.helpers.specs import write_spec


def train_topics(tmp: Path, tiny_bert_dir: Path) -> Path:
    """A run's model/ directory: labels sports, business, ... for a line of news."""
    topics = tmp / "topics.jsonl"
    topics.write_text("\n".join(TOPICS.read_text().splitlines()[:96]) + "\n")
    raw = {
        "name": "topics",
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(topics), "max_length": 16, "eval_fraction": 0.25},
        "train": {"max_steps": 6, "batch_size": 8, "lr": 5e-3, "precision": "fp32"},
    }
    train(load_spec(write_spec(tmp / "spec.yaml", raw)), tmp / "run")
    return tmp / "run" / "model"


def train_gpt(tmp: Path, name: str = "gpt-limits") -> Path:
    """A run's model/ directory: a causal LM with a 256-token context (one byte a token)."""
    (tmp / "corpus.txt").write_text("def add(a, b):\n    return a + b\n\n" * 40)
    raw = {
        "name": name,
        "model": {"source": "bundled:gpt-tiny", "task": "causal-lm", "options": {"n_layer": 2, "n_embd": 32}},
        "data": {"train": str(tmp / "corpus.txt"), "max_length": 32},
        "train": {"max_steps": 2, "batch_size": 4, "precision": "fp32"},
    }
    train(load_spec(write_spec(tmp / "spec.yaml", raw)), tmp / "run")
    return tmp / "run" / "model"


def train_digits(tmp: Path, steps: int) -> Path:
    """A run's model/ directory: the digits example's CNN after `steps` steps, in fp32."""
    spec = load_spec(
        ROOT / "examples" / "digits-cnn.yaml", [f"train.max_steps={steps}", "train.precision=fp32"]
    )
    train(spec, tmp / "run")
    return tmp / "run" / "model"
