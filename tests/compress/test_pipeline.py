"""Compress real (tiny) trained runs end to end: merge, prune, recover, reload, report."""

import json
from typing import get_args

import pytest
import torch

from gpuforge.artifact import load_artifact
from gpuforge.artifact.origin import open_source
from gpuforge.compress.pipeline import (
    CompressError,
    CompressOptions,
    compress,
    make_variant,
    save_variant,
    sweep,
)
from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.spec import CompressSpec, QuantKind, load_spec, parse_spec
from gpuforge.train.engine import train
from gpuforge.weights.quantize import QUANT_KINDS
from tests.helpers.cli import run_cli
from tests.helpers.paths import ROOT, TOPICS
from tests.helpers.runs import train_text_run as _text_run
from tests.helpers.specs import write_spec

REPORT_FIELDS = {"name", "params", "nonzero_params", "disk_bytes", "memory_bytes", "metric"} | {
    "latency_ms_b1",
    "latency_ms_b32",
    "latency_spread_b1",
    "latency_spread_b32",
    "latency_reliable_b1",
    "latency_reliable_b32",
}


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The shipped digits CNN, trained briefly (the real example: channel pruning has conv pairs there)."""
    tmp = tmp_path_factory.mktemp("digits")
    spec = load_spec(ROOT / "examples" / "digits-cnn.yaml", ["train.max_steps=25", "train.precision=fp32"])
    train(spec, tmp / "run")
    return tmp / "run" / "model"


@pytest.fixture(scope="module")
def lora_text_run(tmp_path_factory, tiny_bert_dir):
    """A LoRA adapter (r=4) on the tiny BERT, trained on the first 96 topics sentences (small_topics'
    file): read, never written, by the tests that merge or quantize it."""
    tmp = tmp_path_factory.mktemp("lora")
    topics = tmp / "topics.jsonl"
    topics.write_text("\n".join(TOPICS.read_text().splitlines()[:96]) + "\n")
    return _text_run(tmp, tiny_bert_dir, topics, lora={"r": 4})


def _logits(module, batch):
    with torch.no_grad():
        out = module(**batch) if isinstance(batch, dict) else module(batch)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.slow
def test_merge_gives_a_standalone_model_with_the_adapter_outputs(tmp_path, lora_text_run):
    model_dir = lora_text_run
    rows = compress(model_dir, CompressOptions(merge=True), tmp_path / "merged")
    adapter, tokenizer, _ = load_artifact(model_dir)
    merged, _, manifest = load_artifact(tmp_path / "merged")
    assert manifest.kind == "full" and manifest.compression.merged and not hasattr(merged, "peft_config")
    batch = dict(tokenizer(["sports news tonight", "the market fell"], return_tensors="pt", padding=True))
    assert torch.allclose(_logits(merged, batch), _logits(adapter, batch), atol=1e-5)
    assert [r["name"] for r in rows] == ["original", "merged"] and rows[0]["adapter"]
    assert rows[1]["metric"]["value"] == pytest.approx(rows[0]["metric"]["value"], abs=1e-6)


@pytest.mark.slow
def test_merge_of_a_qlora_adapter_computes_what_the_quantized_base_did(tmp_path, tiny_bert_dir, small_topics):
    pytest.importorskip("bitsandbytes")
    model_dir = _text_run(tmp_path, tiny_bert_dir, small_topics, lora={"r": 4}, quantize_base="nf4")
    compress(model_dir, CompressOptions(merge=True), tmp_path / "merged")
    adapter, tokenizer, _ = load_artifact(model_dir)
    merged, _, _ = load_artifact(tmp_path / "merged")
    batch = dict(tokenizer(["sports news tonight", "the market fell"], return_tensors="pt", padding=True))
    assert torch.allclose(_logits(merged, batch), _logits(adapter, batch), atol=1e-4)


@pytest.mark.slow
def test_merging_a_full_run_is_refused_and_writes_nothing(tmp_path, tiny_bert_dir, small_topics):
    model_dir = _text_run(tmp_path, tiny_bert_dir, small_topics)
    with pytest.raises(CompressError, match="no adapter to merge"):
        compress(model_dir, CompressOptions(merge=True), tmp_path / "merged")
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir())


@pytest.mark.slow
def test_pruning_with_recovery_keeps_the_zeros_and_reports(tmp_path, digits_run):
    options = CompressOptions(prune=0.5, recover_steps=5)
    rows = compress(digits_run, options, tmp_path / "pruned")
    report = json.loads((tmp_path / "pruned" / "report.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["original", "prune50+rec5"]
    assert all(REPORT_FIELDS <= set(v) for v in report["variants"])
    original, pruned = rows
    assert pruned["params"] == original["params"]
    module, _, manifest = load_artifact(tmp_path / "pruned")
    assert manifest.compression.recover.steps == 5
    # the convolutions are half zero after recovery too; the linear head keeps all its weights
    convs = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all((w == 0).float().mean() == pytest.approx(0.5, abs=0.01) for w in convs)
    assert pruned["nonzero_params"] == original["params"] - sum(int((w == 0).sum()) for w in convs)
    assert pruned["metric"]["name"] == "accuracy" and 0 <= pruned["metric"]["value"] <= 1


@pytest.mark.slow
def test_channel_pruning_of_a_python_model_reloads_through_its_builder(tmp_path, digits_run):
    rows = compress(digits_run, CompressOptions(prune=0.3, prune_structure="channel"), tmp_path / "narrow")
    module, _, manifest = load_artifact(tmp_path / "narrow")
    assert manifest.compression.prune.resized
    assert rows[1]["params"] < 0.75 * rows[0]["params"]
    assert sum(p.numel() for p in module.parameters()) == rows[1]["params"]
    assert _logits(module, torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_bad_requests_name_what_is_wrong(tmp_path, digits_run):
    with pytest.raises(GpuforgeError, match="not a gpuforge model directory"):
        compress(tmp_path, CompressOptions(prune=0.5), tmp_path / "x")
    with pytest.raises(CompressError, match="2:4 removes exactly half"):
        compress(digits_run, CompressOptions(prune=0.3, prune_structure="2:4"), tmp_path / "x")
    with pytest.raises(CompressError, match="--recover-steps fine-tunes after pruning"):
        compress(digits_run, CompressOptions(quantize="int8", recover_steps=3), tmp_path / "x")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(CompressError, match="--force"):
        compress(digits_run, CompressOptions(prune=0.5), tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_the_cli_says_what_is_wrong_in_one_line(tmp_path):
    result = run_cli("compress", str(tmp_path), "--prune", "1.5", "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1]
        == "gpuforge: error: --prune: sparsity must be in [0, 1), got 1.5"
    )
    result = run_cli("compress", str(tmp_path), "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "nothing to do" in result.stderr


@pytest.mark.slow
def test_the_spec_compress_section_runs_after_training(tmp_path):
    raw = load_spec(ROOT / "examples" / "digits-cnn.yaml").model_dump(mode="json")
    raw["train"].update(max_steps=8, precision="fp32")
    raw["compress"] = {"prune": {"amount": 0.3, "structure": "channel"}}
    result = run_cli("train", str(write_spec(tmp_path / "job.yaml", raw)), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "run" / "compressed" / "report.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["original", "channel30"]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "compressed" and events[-1]["path"] == "compressed"
    assert "channel30" in result.stdout


STRUCTURES = "must be 'unstructured', '2:4' or 'channel'"
KINDS = "must be 'int8', 'int4' or 'int8-dynamic'"
# (the spec's compress: section, its error; the same request on the command line, its error)
SAME_REFUSALS = [
    ({"prune": {"amount": 1.5}}, "compress.prune.amount: sparsity must be in [0, 1)",
     {"prune": 1.5}, "--prune: sparsity must be in [0, 1)"),
    ({"prune": {"structure": "4:8"}}, f"compress.prune.structure: {STRUCTURES}",
     {"prune_structure": "4:8"}, f"--prune-structure: {STRUCTURES}"),
    ({"prune": {"amount": 0.3, "structure": "2:4"}}, "compress.prune: structure 2:4 removes exactly half",
     {"prune": 0.3, "prune_structure": "2:4"}, "--prune-structure 2:4 removes exactly half: --prune 0.3"),
    ({"prune": {"amount": 0, "recover_steps": 3}}, "compress.prune: recover_steps fine-tunes after pruning",
     {"recover_steps": 3}, "--recover-steps fine-tunes after pruning: it needs --prune > 0"),
    ({"prune": {"recover_steps": -1}}, "compress.prune.recover_steps: must be >= 0",
     {"recover_steps": -1}, "--recover-steps: must be >= 0"),
    ({"quantize": "int2"}, f"compress.quantize: {KINDS}", {"quantize": "int2"}, f"--quantize: {KINDS}"),
]  # fmt: skip


@pytest.mark.parametrize("section, in_spec, flags, on_the_command_line", SAME_REFUSALS)
def test_the_spec_and_the_command_line_refuse_the_same_requests(section, in_spec, flags, on_the_command_line):
    """One definition of the bounds (spec.py), each refusal naming the field as its user wrote it."""
    raw = load_spec(ROOT / "examples" / "digits-cnn.yaml").model_dump(mode="json")
    with pytest.raises(SpecError) as refused:
        parse_spec({**raw, "compress": section}, ROOT)
    assert in_spec in str(refused.value)
    with pytest.raises(CompressError) as refused:
        CompressOptions(**flags)
    assert on_the_command_line in str(refused.value)


def test_a_spec_section_becomes_the_options_of_its_variant():
    section = CompressSpec(prune={"amount": 0.3, "structure": "channel", "recover_steps": 4}, quantize="int8")
    options = CompressOptions.from_spec(section)
    assert options.name == "channel30+rec4+int8" and options == CompressOptions(
        prune=0.3, prune_structure="channel", recover_steps=4, quantize="int8"
    )
    assert CompressOptions.from_spec(CompressSpec(merge=True)).name == "merged"
    assert get_args(QuantKind) == QUANT_KINDS  # the bound and the kinds weights/quantize.py implements


@pytest.mark.slow
def test_a_bad_compress_section_names_the_field(tmp_path):
    raw = load_spec(ROOT / "examples" / "digits-cnn.yaml").model_dump(mode="json")
    raw["compress"] = {"prune": {"amount": 1.2}}
    result = run_cli("plan", str(write_spec(tmp_path / "job.yaml", raw)))
    assert result.returncode == 2 and "compress.prune.amount" in result.stderr


@pytest.mark.parametrize("kind", ["int8", "int4", "int8-dynamic"])
def test_a_quantized_variant_reloads_with_the_outputs_it_was_saved_with(tmp_path, digits_run, kind):
    source = open_source(digits_run)
    options = CompressOptions(prune=0.3, prune_structure="channel", quantize=kind)
    built, tokenizer, manifest = make_variant(source, options)
    save_variant(built, tokenizer, manifest, tmp_path / "v")
    reloaded, _, saved = load_artifact(tmp_path / "v")
    assert saved.weights == "quantized.pt" and saved.quantization == kind
    x = torch.rand(4, 1, 8, 8)
    assert torch.equal(_logits(reloaded, x), _logits(built.module, x))


@pytest.mark.slow
def test_a_quantized_transformer_reloads_from_its_config(tmp_path, lora_text_run):
    model_dir = lora_text_run
    source = open_source(model_dir)
    built, tokenizer, manifest = make_variant(source, CompressOptions(quantize="int8"))
    assert manifest.compression.merged  # an adapter is merged before its weights are quantized
    save_variant(built, tokenizer, manifest, tmp_path / "v")
    assert not (tmp_path / "v" / "model.safetensors").exists()
    reloaded, tokenizer, _ = load_artifact(tmp_path / "v")
    batch = dict(tokenizer(["sports news tonight"], return_tensors="pt"))
    assert torch.equal(_logits(reloaded, batch), _logits(built.module, batch))


@pytest.mark.slow
def test_a_sweep_measures_every_variant_marks_the_front_and_reports_what_failed(tmp_path, digits_run):
    rows = sweep(digits_run, tmp_path / "sweep", onnx=True)
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    names = [v["name"] for v in report["variants"]]
    assert names[0] == "original" and {"int8", "int4", "int8-dynamic", "channel30+int8"} <= set(names)
    assert len(rows) == len(names) and all(REPORT_FIELDS <= set(v) for v in rows)
    # the ONNX exports on the same axes: fp32 answers as the original does, int8 is smaller
    by_name = {v["name"]: v for v in rows}
    original, onnx, onnx_int8 = by_name["original"], by_name["onnx-fp32"], by_name["onnx-int8"]
    assert onnx["metric"] == original["metric"] and onnx["runtime"].startswith("onnxruntime")
    assert onnx_int8["memory_bytes"] < 0.5 * onnx["memory_bytes"]
    # the digits CNN has no linear layer but its head: 2:4 has nothing to prune, and says why
    assert [f["name"] for f in report["failed"]] == ["2:4"]
    assert "not convolutions" in report["failed"][0]["error"]
    front = [v for v in rows if v["pareto"]]
    assert front and all((tmp_path / "sweep" / v["name"]).is_dir() for v in rows[1:])
    # nothing on the front is beaten on all three axes by another variant
    smallest = min(rows, key=lambda v: v["memory_bytes"])
    assert smallest["pareto"] or any(
        v["memory_bytes"] == smallest["memory_bytes"] and v["pareto"] for v in rows
    )


def test_recovery_after_an_auto_lr_run_fine_tunes_at_the_rate_its_range_test_picked(tmp_path):
    spec = load_spec(
        ROOT / "examples" / "digits-cnn.yaml", ["train.max_steps=4", "train.precision=fp32", "train.lr=auto"]
    )
    train(spec, tmp_path / "run")
    picked = json.loads((tmp_path / "run" / "lr_find.json").read_text())["lr"]
    options = CompressOptions(prune=0.3, prune_structure="channel", recover_steps=2)
    _, _, manifest = make_variant(open_source(tmp_path / "run" / "model"), options)
    assert manifest.compression.recover.lr == pytest.approx(picked)
