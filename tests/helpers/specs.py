"""Spec files for tests: any dict as YAML, and the tiny image model on the real digits."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helpers.paths import TEST_MODELS


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def image_spec(tmp_path: Path, **train) -> dict:
    """A spec for the tiny image model on the real digits; seconds to run."""
    return {
        "name": "tiny-digits",
        "model": {
            "source": f"python:{TEST_MODELS}:image_model",
            "task": "image-classification",
            "options": train.pop("options", {}),
        },
        "data": {"train": "sklearn:digits", "eval_fraction": 0.2, **train.pop("data", {})},
        # fp32 unless a test asks: `auto` picks bf16 on some CPUs, and exact comparisons need one choice
        "train": {"max_steps": 6, "batch_size": 32, "lr": 1e-2, "log_every": 1, "precision": "fp32", **train},
    }
