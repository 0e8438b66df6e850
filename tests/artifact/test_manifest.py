"""gpuforge.json as a typed manifest: what is written is what is read, old files load as they are, and a
file that names weights outside its directory is refused."""

import json
import logging

import pytest

from gpuforge.artifact import MANIFEST, ArtifactError, Manifest, load_artifact, read_manifest, write_manifest
from gpuforge.artifact.manifest import SCHEMA_VERSION, Compression, PruneRecord, QuantizeRecord
from gpuforge.errors import ModelError

# a digits run's manifest as gpuforge wrote it before manifests had a schema_version
BEFORE_VERSIONS = {
    "format": "state_dict", "kind": "full", "base": None, "pretrained": False, "lora_targets": None,
    "modules_to_save": None, "quantize_base": None, "task": "image-classification",
    "source": "python:/x/digits_cnn.py:build", "options": {"channels": 32}, "labels": ["0", "1"],
    "num_labels": 2, "max_length": 128, "tokenizer": None, "job": "digits-cnn", "step": 5,
    "precision": "fp32", "sample_shape": [1, 8, 8],
}  # fmt: skip


def _write(model_dir, content) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / MANIFEST).write_text(json.dumps(content, indent=2) + "\n")


def test_a_written_manifest_reads_back_the_same_and_keeps_its_keys_in_order(tmp_path):
    done = Compression(
        from_="/runs/a/model", options={"prune": 0.3}, name="channel30+int8",
        prune=PruneRecord(structure="channel", amount=0.3, layers=2, resized={"0": {"out_channels": 22}}),
        quantize=QuantizeRecord(kind="int8", layers=2, skip=["0"]), params=100, nonzero_params=90,
    )  # fmt: skip
    manifest = Manifest(**BEFORE_VERSIONS, compression=done, weights="quantized.pt")
    write_manifest(tmp_path, manifest)
    on_disk = json.loads((tmp_path / MANIFEST).read_text())
    assert list(on_disk) == [*BEFORE_VERSIONS, "compression", "weights"]  # version 1: no schema_version
    assert on_disk["compression"]["from"] == "/runs/a/model" and "recover" not in on_disk["compression"]
    read = read_manifest(tmp_path)
    assert read == manifest and read.to_dict() == on_disk
    assert read.quantization == "int8" and read.compression.prune.resized == {"0": {"out_channels": 22}}


def test_a_manifest_from_before_schema_versions_loads_and_is_rewritten_unchanged(tmp_path):
    _write(tmp_path, BEFORE_VERSIONS)
    manifest = read_manifest(tmp_path)
    assert (
        manifest.schema_version == 1 and manifest.sample_shape == [1, 8, 8] and manifest.compression is None
    )
    assert manifest["job"] == "digits-cnn" and not manifest.is_adapter
    # no key it lacked (compression, weights) appears; only the version is added
    assert manifest.to_dict() == BEFORE_VERSIONS


def test_a_newer_manifest_loads_and_keeps_what_this_version_does_not_know(tmp_path, caplog):
    newer = {**BEFORE_VERSIONS, "schema_version": SCHEMA_VERSION + 1, "calibration": {"samples": 64}}
    newer["compression"] = {"name": "x", "sparsity_map": [0.5], "quantize": {"kind": "int8", "group": 32}}
    _write(tmp_path, newer)
    with caplog.at_level(logging.WARNING, logger="gpuforge.artifact"):
        manifest = read_manifest(tmp_path)
    assert "newer than this gpuforge's" in caplog.text
    write_manifest(tmp_path, manifest)
    assert json.loads((tmp_path / MANIFEST).read_text()) == newer


@pytest.mark.parametrize(
    "content, named",
    [
        ({}, "format: Field required"),
        ({**BEFORE_VERSIONS, "kind": "half"}, "kind: must be 'full' or 'adapter', got 'half'"),
        ({**BEFORE_VERSIONS, "num_labels": "ten"}, "num_labels: must be an integer"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_file_and_field(tmp_path, content, named):
    _write(tmp_path, content)
    with pytest.raises(ArtifactError, match=f"{MANIFEST}: .*{named}"):
        read_manifest(tmp_path)


def test_no_manifest_is_not_a_model_directory(tmp_path):
    with pytest.raises(ArtifactError, match="not a gpuforge model directory"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("weights", ["../x.pt", "/etc/passwd", "sub/../../x.pt", "link.pt", None])
def test_weights_named_outside_the_directory_are_refused(tmp_path, weights):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "link.pt").symlink_to(tmp_path / "elsewhere.pt")  # inside by name, outside in fact
    manifest = Manifest(**BEFORE_VERSIONS, weights=weights)
    with pytest.raises(ModelError, match="names weights outside the directory|names no weights file"):
        manifest.weights_path(model_dir)
    (model_dir / "quantized.pt").touch()
    inside = Manifest(**BEFORE_VERSIONS, weights="quantized.pt")
    assert inside.weights_path(model_dir) == (model_dir / "quantized.pt").resolve()


@pytest.mark.slow
def test_loading_a_quantized_variant_that_names_weights_outside_is_refused(tmp_path):
    """Through load_artifact: the check holds where the weights would be read."""
    from transformers import BertConfig

    model_dir = tmp_path / "model"
    BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
               intermediate_size=8).save_pretrained(str(model_dir))  # fmt: skip
    (tmp_path / "x.pt").write_bytes(b"not weights")
    _write(model_dir, {
        "format": "transformers", "kind": "full", "task": "sequence-classification",
        "source": f"hf:{model_dir}", "compression": {"quantize": {"kind": "int8", "skip": []}},
        "weights": "../x.pt",
    })  # fmt: skip
    with pytest.raises(ModelError, match="names weights outside the directory: ../x.pt"):
        load_artifact(model_dir)
