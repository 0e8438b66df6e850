from pathlib import Path

import pytest
import yaml

from gpuforge.errors import SpecError
from gpuforge.spec import JobSpec, apply_override, load_spec, parse_bytes, parse_spec

MINIMAL = {
    "model": {"source": "bundled:minilm", "task": "sequence-classification"},
    "data": {"train": "data.jsonl"},
}


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_are_filled_and_paths_resolved_against_the_spec_dir(tmp_path):
    spec = load_spec(_spec(tmp_path, yaml.safe_dump(MINIMAL)))
    assert spec.name == "job"
    assert spec.data.train == str(tmp_path / "data.jsonl")
    assert spec.train.epochs == 1.0 and spec.train.max_steps is None
    assert spec.train.precision == "auto" and spec.train.batch_size == 32
    assert spec.cost.usd_per_hour == 0.0 and spec.distributed.strategy == "none"
    # the resolved spec round-trips through YAML unchanged
    assert JobSpec.model_validate(yaml.safe_load(spec.to_yaml())) == spec


def test_builtin_data_and_hf_dir_and_python_file_are_resolved_correctly(tmp_path):
    raw = {
        "model": {"source": "python:models/m.py:build", "task": "image-classification"},
        "data": {"train": "sklearn:digits"},
    }
    spec = parse_spec(raw, tmp_path)
    assert spec.data.train == "sklearn:digits"
    assert spec.model.source == f"python:{tmp_path / 'models' / 'm.py'}:build"
    hf = parse_spec({**MINIMAL, "model": {"source": "hf:my-model", "task": "causal-lm"}}, tmp_path)
    assert hf.model.source == f"hf:{tmp_path / 'my-model'}"
    module = parse_spec({**MINIMAL, "model": {"source": "python:pkg.mod:fn", "task": "causal-lm"}}, tmp_path)
    assert module.model.source == "python:pkg.mod:fn"


@pytest.mark.parametrize(
    "override, check",
    [
        ("train.lr=1e-3", lambda s: s.train.lr == 1e-3),
        ("train.max_steps=7", lambda s: s.train.max_steps == 7),
        ("train.precision=bf16", lambda s: s.train.precision == "bf16"),
        ("cost.usd_per_hour=2.5", lambda s: s.cost.usd_per_hour == 2.5),
        ("model.options.n_layer=2", lambda s: s.model.options == {"n_layer": 2}),
        ("name=renamed", lambda s: s.name == "renamed"),
    ],
)
def test_set_overrides(tmp_path, override, check):
    assert check(load_spec(_spec(tmp_path, yaml.safe_dump(MINIMAL)), [override]))


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: a\n  model: b\n", "line 2 column 8: malformed YAML"),
        ("- a\n- b\n", "must be a mapping"),
        (yaml.safe_dump({**MINIMAL, "trian": {}}), "trian: unknown key"),
        (yaml.safe_dump({**MINIMAL, "train": {"interval": 3}}), "train.interval: unknown key"),
        (yaml.safe_dump({**MINIMAL, "train": {"seed": -1}}), "train.seed: must be >= 0"),
        (yaml.safe_dump({**MINIMAL, "train": {"lr": -1}}), "train.lr: must be > 0"),
        (yaml.safe_dump({**MINIMAL, "train": {"lr": "fast"}}), "train.lr:"),
        (yaml.safe_dump({**MINIMAL, "train": {"batch_size": 0}}), "train.batch_size"),
        (yaml.safe_dump({**MINIMAL, "train": {"batch_size": 32, "global_batch_size": 48}}), "multiple of"),
        (yaml.safe_dump({**MINIMAL, "train": {"precision": "fp8"}}), "train.precision"),
        (
            yaml.safe_dump({**MINIMAL, "model": {"source": "hub:bert", "task": "causal-lm"}}),
            "unknown scheme 'hub'",
        ),
        (
            yaml.safe_dump({**MINIMAL, "model": {"source": "bundled:minilm", "task": "regression"}}),
            "model.task",
        ),
        (yaml.safe_dump({"data": {"train": "x"}}), "model: Field required"),
        (yaml.safe_dump({**MINIMAL, "resources": {"max_memory": "lots"}}), "resources.max_memory"),
        (
            yaml.safe_dump({**MINIMAL, "adapt": {"quantize_base": "nf4"}}),
            "adapt: quantize_base needs lora",
        ),
        (yaml.safe_dump({**MINIMAL, "adapt": {"lora": {"r": 0}}}), "adapt.lora.r: must be >= 1"),
        (yaml.safe_dump({**MINIMAL, "adapt": {"lora": {"rank": 8}}}), "adapt.lora.rank: unknown key"),
        (
            yaml.safe_dump({**MINIMAL, "train": {"batch_size": "auto"}}),
            "train: global_batch_size is required",
        ),
        (
            yaml.safe_dump({**MINIMAL, "resources": {"devices": 2}}),
            "resources.devices: 2 needs distributed.strategy ddp or fsdp",
        ),
        (
            yaml.safe_dump({**MINIMAL, "resources": {"devices": 1.5}}),
            "resources.devices: 1.5: whole devices (1, 2, ...) or a fraction",
        ),
        (yaml.safe_dump({**MINIMAL, "resources": {"devices": 0.33}}), "a multiple of 0.05"),
        (yaml.safe_dump({**MINIMAL, "resources": {"devices": 0}}), "resources.devices"),
        (
            yaml.safe_dump({**MINIMAL, "resources": {"devices": 0.5}, "distributed": {"strategy": "ddp"}}),
            "resources.devices: 0.5 is a fraction of one device, one process",
        ),
        (
            yaml.safe_dump({**MINIMAL, "distributed": {"strategy": "fsdp", "gradient_compression": "bf16"}}),
            "distributed.gradient_compression: bf16 compresses what DDP all-reduces",
        ),
        (
            yaml.safe_dump({**MINIMAL, "distributed": {"powersgd_rank": 0}}),
            "distributed.powersgd_rank: must be >= 1",
        ),
        (
            yaml.safe_dump(
                {
                    **MINIMAL,
                    "resources": {"devices": 4},
                    "distributed": {"strategy": "ddp"},
                    "train": {"batch_size": 2},
                }
            ),
            "4 processes share a global batch of 2 examples",
        ),
        (
            yaml.safe_dump(
                {
                    **MINIMAL,
                    "resources": {"devices": 2},
                    "distributed": {"strategy": "fsdp"},
                    "train": {"batch_size": 3},
                }
            ),
            "FSDP's 2 processes must share each step's 3 examples evenly",
        ),
        (
            yaml.safe_dump(
                {
                    **MINIMAL,
                    "distributed": {"strategy": "fsdp"},
                    "train": {"batch_size": "auto", "global_batch_size": 8},
                }
            ),
            "train.batch_size: auto is not supported with distributed.strategy fsdp",
        ),
    ],
)
def test_errors_name_the_field_and_the_problem(tmp_path, text, message):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(tmp_path, text))
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(str(tmp_path / "job.yaml"))


def test_missing_spec_file_and_directory(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "absent.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


@pytest.mark.parametrize("bad", ["train.lr", "=3", "train..lr=3"])
def test_malformed_set(bad):
    with pytest.raises(SpecError, match="--set"):
        apply_override({}, bad)


def test_set_into_a_non_section_is_an_error():
    with pytest.raises(SpecError, match="train.lr is not a section"):
        apply_override({"train": {"lr": 1.0}}, "train.lr.x=3")


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("8 parsecs")


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ({"train": {"learning_rate": 1e-3}}, "train.learning_rate: unknown key (did you mean train.lr?)"),
        ({"train": {"lerning_rate": 1e-3}}, "(did you mean train.lr?)"),
        ({"train": {"num_epochs": 2}}, "(did you mean train.epochs?)"),
        ({"train": {"batch": 8}}, "(did you mean train.batch_size?)"),
        ({"train": {"warmup_step": 8}}, "(did you mean train.warmup_steps?)"),
        ({"adapt": {"lora": {"rank": 8}}}, "adapt.lora.rank: unknown key (did you mean adapt.lora.r?)"),
        ({"trian": {}}, "trian: unknown key (did you mean train?)"),
    ],
)
def test_an_unknown_key_suggests_the_field_it_probably_meant(tmp_path, typo, suggestion):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(tmp_path, yaml.safe_dump({**MINIMAL, **typo})))
    assert suggestion in str(err.value)


def test_an_unknown_key_like_no_field_gets_no_suggestion(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(tmp_path, yaml.safe_dump({**MINIMAL, "train": {"zebra": 1}})))
    assert str(err.value).endswith("train.zebra: unknown key")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=abc", "--set train.lr=abc: must be a number or 'auto', got 'abc'"),
        ("train.batch_size=x", "--set train.batch_size=x: must be an integer or 'auto', got 'x'"),
        ("train.max_steps=1.5", "--set train.max_steps=1.5: must be a whole number, got 1.5"),
        (
            "train.precision=fp8",
            "--set train.precision=fp8: must be 'auto', 'bf16', 'fp16' or 'fp32', got 'fp8'",
        ),
        ("train.lerning_rate=1", "--set train.lerning_rate=1: unknown key (did you mean train.lr?)"),
    ],
)
def test_a_problem_made_by_set_names_the_set_not_the_file(tmp_path, override, message):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(tmp_path, yaml.safe_dump(MINIMAL)), [override])
    assert str(err.value) == message


def test_a_fraction_of_a_device_is_one_process_on_that_share_and_whole_numbers_stay_whole(tmp_path):
    half = parse_spec({**MINIMAL, "resources": {"devices": 0.5}}, tmp_path)
    assert half.resources.share == 0.5 and half.resources.processes == 1
    whole = parse_spec({**MINIMAL, "resources": {"devices": 1.0}}, tmp_path)
    assert whole.resources.devices == 1 and isinstance(whole.resources.devices, int)
    assert whole.resources.share is None
