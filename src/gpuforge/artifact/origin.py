"""Where a model directory came from: its run's spec beside it, and that run's data split rebuilt, which
compression measures its variants on and an endpoint measures load-time quantization on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge.artifact.load import load_saved_tokenizer
from gpuforge.artifact.manifest import MANIFEST, ArtifactError, Manifest, read_manifest
from gpuforge.data import prepare_data
from gpuforge.spec import JobSpec, load_spec

__all__ = ["ArtifactError", "Source", "open_source"]


@dataclass
class Source:
    """The artifact being compressed and what measuring it needs."""

    model_dir: Path
    manifest: Manifest
    spec: JobSpec
    data: Any  # PreparedData of the run (train for recovery, eval for the metric)
    run_dir: Path  # the model's run (<run>/model, <run>/compressed/<name>): its lr_find.json, lr auto

    @property
    def is_adapter(self) -> bool:
        return self.manifest.is_adapter


def _run_spec(model_dir: Path) -> Path:
    """The spec of the run a model directory belongs to: <run>/model, or a variant its compress: section
    made, <run>/compressed/<name>."""
    beside = model_dir.parent / "spec.yaml"
    if not beside.is_file() and model_dir.parent.name == "compressed":
        return model_dir.parent.parent / "spec.yaml"
    return beside


def open_source(model_dir: str | Path, spec_path: str | Path | None = None) -> Source:
    """Check that `model_dir` is a gpuforge model and rebuild its run's data split."""
    model_dir = Path(model_dir)
    if not (model_dir / MANIFEST).is_file():
        raise ArtifactError(f"{model_dir}: not a gpuforge model directory (no {MANIFEST}); pass <run>/model")
    manifest = read_manifest(model_dir)
    spec_path = Path(spec_path) if spec_path else _run_spec(model_dir)
    if not spec_path.is_file():
        raise ArtifactError(f"{spec_path}: the run's spec is needed for its eval data; pass --spec")
    spec = load_spec(spec_path)
    tokenizer = load_saved_tokenizer(model_dir, manifest)  # the weights are loaded per variant
    data = prepare_data(spec.data, spec.model.task, tokenizer, spec.train.seed, manifest.num_labels)
    if data.eval is None or len(data.eval) == 0:
        raise ArtifactError(f"{spec_path}: the run has no eval split (data.eval_fraction 0) to measure on")
    return Source(model_dir, manifest, spec, data, _run_spec(model_dir).parent)
