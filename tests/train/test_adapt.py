"""LoRA through PEFT: every source, adapter-only checkpoints and artifacts, exact resume, clear errors."""

import pytest
import torch

from gpuforge.artifact import load_artifact
from gpuforge.data import prepare_data
from gpuforge.errors import SpecError
from gpuforge.models import ModelRequest, build_model, load_tokenizer
from gpuforge.models.base import BuiltModel
from gpuforge.runs import RunDir
from gpuforge.runtime.evaluate import evaluate
from gpuforge.runtime.precision import Precision
from gpuforge.spec import LoraSpec, parse_spec
from gpuforge.train.adapt import apply_lora, resolve_targets
from gpuforge.train.engine import train
from tests.helpers.paths import TEST_MODELS
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec


def _text_job(tiny_bert_dir, topics, precision="fp32", **adapt):
    return {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(topics), "max_length": 32, "eval_fraction": 0.25},
        "train": {"max_steps": 6, "batch_size": 8, "lr": 5e-3, "checkpoint_every": 3, "precision": precision},
        "adapt": adapt,
    }


def _eval_loss(module, tokenizer, raw, tmp_path, summary) -> float:
    """The eval loss of a reloaded model on the job's own held-out split."""
    spec = parse_spec(raw, tmp_path)
    data = prepare_data(spec.data, spec.model.task, tokenizer, spec.train.seed)
    built = BuiltModel(module, True, "", adapter=True)
    precision = Precision(summary["precision"], "")
    return evaluate(built, spec.model.task, data.eval, 8, precision, torch.device("cpu"))["loss"]


def test_lora_trains_a_fraction_and_saves_the_adapter_alone(tmp_path, tiny_bert_dir, small_topics):
    full = train(parse_spec(_text_job(tiny_bert_dir, small_topics), tmp_path), tmp_path / "full")
    lora = train(
        parse_spec(_text_job(tiny_bert_dir, small_topics, lora={"r": 4}), tmp_path), tmp_path / "lora"
    )
    assert lora["adapter"] == "lora" and full["adapter"] is None
    assert lora["trainable_parameters"] < 0.2 * full["trainable_parameters"]
    assert lora["optimizer_state_bytes"] < 0.2 * full["optimizer_state_bytes"]
    run = RunDir(tmp_path / "lora")
    ckpt = run.latest_checkpoint()[1]
    assert (ckpt / "adapter.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    assert (run.model_dir / "adapter_model.safetensors").exists()
    assert not (run.model_dir / "model.safetensors").exists()

    # the saved adapter, loaded on its rebuilt base, scores the eval set exactly as the trained model did
    module, tokenizer, manifest = load_artifact(run.model_dir)
    assert manifest["kind"] == "adapter" and manifest["base"] == f"hf:{tiny_bert_dir}"
    again = _eval_loss(
        module, tokenizer, _text_job(tiny_bert_dir, small_topics, lora={"r": 4}), tmp_path, lora
    )
    assert again == pytest.approx(lora["eval"]["loss"], rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_on_a_python_model_resumes_the_same_loss_curve(tmp_path, precision):
    raw = image_spec(tmp_path, max_steps=10, checkpoint_every=4, precision=precision)
    raw["adapt"] = {
        "lora": {"r": 4, "target_modules": ["net.1"], "modules_to_save": ["net.4"], "dropout": 0.1}
    }
    reference = train(parse_spec(raw, tmp_path), tmp_path / "reference")
    assert reference["adapter"] == "lora"
    stopped = train(parse_spec(raw, tmp_path), tmp_path / "run", SignalAt(5))
    assert stopped["status"] == "cancelled"
    resumed = train(parse_spec(raw, tmp_path), tmp_path / "run")
    assert resumed["resumed_from"] == 5
    losses = [m["loss"] for m in RunDir(tmp_path / "run").metrics()]
    assert losses == pytest.approx([m["loss"] for m in RunDir(tmp_path / "reference").metrics()], rel=1e-6)
    module, _, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["lora_targets"] == ["net.1"] and module(torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_lora_on_the_bundled_gpt_uses_its_attention_projection():
    built = build_model(
        ModelRequest("bundled:gpt-tiny", "causal-lm", options={"n_layer": 2, "n_embd": 32, "n_head": 2})
    )
    adapted = apply_lora(built, LoraSpec(r=2), "causal-lm")
    assert adapted.extra["lora_targets"] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    tokens = load_tokenizer("bundled:gpt-tiny", "causal-lm", None)("hello", return_tensors="pt")
    assert adapted.module(**tokens).logits.shape[-1] == built.module.config.vocab_size


def test_a_target_matching_nothing_names_the_modules_it_saw():
    built = build_model(
        ModelRequest(f"python:{TEST_MODELS}:image_model", "image-classification", num_labels=3)
    )
    with pytest.raises(
        SpecError, match=r"\['attn\*'\] match no adaptable module; modules seen: net.1, net.4"
    ):
        resolve_targets(built.module, ["attn*"])
    with pytest.raises(SpecError, match="default targets"):
        apply_lora(built, LoraSpec(), "image-classification")
    with pytest.raises(SpecError, match="modules_to_save: head9 match no module"):
        apply_lora(
            built, LoraSpec(target_modules=["net.1"], modules_to_save=["head9"]), "image-classification"
        )


def test_activation_checkpointing_keeps_the_loss_curve(tmp_path, tiny_bert_dir, small_topics):
    plain = _text_job(tiny_bert_dir, small_topics, lora={"r": 4})
    checkpointed = {**plain, "train": {**plain["train"], "gradient_checkpointing": True}}
    train(parse_spec(plain, tmp_path), tmp_path / "plain")
    train(parse_spec(checkpointed, tmp_path), tmp_path / "ckpt")
    losses = [m["loss"] for m in RunDir(tmp_path / "ckpt").metrics()]
    assert losses == pytest.approx([m["loss"] for m in RunDir(tmp_path / "plain").metrics()], rel=1e-5)


def test_activation_checkpointing_needs_a_transformers_model(tmp_path):
    with pytest.raises(SpecError, match="train.gradient_checkpointing: only transformers models"):
        train(parse_spec(image_spec(tmp_path, gradient_checkpointing=True), tmp_path), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_compiled_model_trains_the_same_curve_and_checkpoints_plain_names(tmp_path):
    train(
        parse_spec(image_spec(tmp_path, max_steps=4, options={"dropout": 0.0}), tmp_path), tmp_path / "eager"
    )
    raw = image_spec(tmp_path, max_steps=4, compile=True, options={"dropout": 0.0})
    train(parse_spec(raw, tmp_path), tmp_path / "compiled")
    losses = [m["loss"] for m in RunDir(tmp_path / "compiled").metrics()]
    assert losses == pytest.approx([m["loss"] for m in RunDir(tmp_path / "eager").metrics()], rel=1e-4)
    module, _, _ = load_artifact(tmp_path / "compiled" / "model")  # names without torch.compile's prefix
    assert module(torch.rand(1, 1, 8, 8)).shape == (1, 10)


@pytest.mark.slow
@pytest.mark.parametrize("kind, precision", [("nf4", "fp32"), ("int8", "fp32"), ("nf4", "bf16")])
def test_qlora_on_cpu_quantizes_the_base_trains_and_resumes(
    tmp_path, tiny_bert_dir, small_topics, kind, precision
):
    pytest.importorskip("bitsandbytes")
    raw = _text_job(tiny_bert_dir, small_topics, precision, lora={"r": 4}, quantize_base=kind)
    reference = train(parse_spec(raw, tmp_path), tmp_path / "reference")
    full = train(
        parse_spec(_text_job(tiny_bert_dir, small_topics, lora={"r": 4}), tmp_path), tmp_path / "lora"
    )
    assert reference["adapter"] == f"qlora-{kind}"
    assert reference["weight_bytes"] < full["weight_bytes"]  # the quantized linear layers are smaller
    stopped = train(parse_spec(raw, tmp_path), tmp_path / "run", SignalAt(4))
    assert stopped["status"] == "cancelled"
    train(parse_spec(raw, tmp_path), tmp_path / "run")
    losses = [m["loss"] for m in RunDir(tmp_path / "run").metrics()]
    assert losses == pytest.approx([m["loss"] for m in RunDir(tmp_path / "reference").metrics()], rel=1e-5)
    module, tokenizer, manifest = load_artifact(tmp_path / "run" / "model")
    assert manifest["quantize_base"] == kind
    again = _eval_loss(module, tokenizer, raw, tmp_path, reference)
    assert again == pytest.approx(reference["eval"]["loss"], rel=1e-4)


def test_a_quantized_base_needs_lora(tmp_path):
    with pytest.raises(SpecError, match="adapt: quantize_base needs lora"):
        parse_spec({**image_spec(tmp_path), "adapt": {"quantize_base": "nf4"}}, tmp_path)


@pytest.mark.slow
def test_lora_in_bf16_keeps_the_frozen_base_in_bf16_and_the_factors_in_fp32(
    tmp_path, tiny_bert_dir, small_topics
):
    raw = _text_job(tiny_bert_dir, small_topics, lora={"r": 4})
    raw["train"]["precision"] = "bf16"
    from gpuforge.train.setup import build_job

    job = build_job(parse_spec(raw, tmp_path))
    dtypes = {p.dtype for p in job.module.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in job.module.parameters() if p.requires_grad} == {torch.float32}
    summary = train(parse_spec(raw, tmp_path), tmp_path / "run")
    assert summary["status"] == "finished" and summary["precision"] == "bf16"


@pytest.mark.parametrize("named", [None, ["classifier"]])
def test_the_classification_head_is_saved_once_whether_or_not_the_spec_names_it(tiny_bert_dir, named):
    built = build_model(ModelRequest(f"hf:{tiny_bert_dir}", "sequence-classification", num_labels=3))
    adapted = apply_lora(built, LoraSpec(r=2, modules_to_save=named), "sequence-classification")
    # PEFT adds the names of the heads it knows ("classifier", "score") to the list it is given
    assert adapted.extra["modules_to_save"] == ["classifier"]
