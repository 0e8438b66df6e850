"""A 2-rank `distributed.strategy: ddp` spec on the digits: a model that 2 processes train as 1 does."""

from __future__ import annotations

from pathlib import Path

import yaml

# no BatchNorm, no dropout: 2 processes must then compute what 1 does (BatchNorm would see half batches)
MLP_SOURCE = """
from torch import nn

def build(num_labels: int, width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, num_labels))
"""


def write_ddp_spec(tmp_path: Path, name: str = "mlp", **sections) -> Path:
    """`tmp_path/{name}.yaml` (and the model's `mlp.py` beside it); each keyword merges into its section."""
    (tmp_path / "mlp.py").write_text(MLP_SOURCE)
    spec = {
        "name": name,
        "model": {"source": "python:mlp.py:build", "task": "image-classification"},
        "data": {"train": "sklearn:digits", "eval_fraction": 0.1},
        "train": {"max_steps": 12, "batch_size": 32, "lr": 3e-3, "precision": "fp32", "log_every": 1},
        "resources": {"devices": 2},
        "distributed": {"strategy": "ddp"},
    }
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
