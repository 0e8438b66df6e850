"""ONNX exports of real (tiny) trained runs: each model kind exported by torch's exporter, run by
onnxruntime on the run's held-out split beside the torch model (export_report.json), loaded and served as
an endpoint's model, and the requests an export must refuse."""

import json
import time

import pytest
import torch
from fastapi.testclient import TestClient

pytest.importorskip("onnxruntime", reason="the export extra (onnx, onnxruntime) is not installed")

from gpuforge.artifact import load_artifact, read_manifest  # noqa: E402
from gpuforge.errors import GpuforgeError  # noqa: E402
from gpuforge.export.onnx import ExportError, export_onnx  # noqa: E402
from gpuforge.export.parity import measure_parity  # noqa: E402
from gpuforge.serve.options import ServeOptions  # noqa: E402
from gpuforge.serve.predict import load_predictor  # noqa: E402
from gpuforge.serve.worker import create_worker  # noqa: E402
from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.paths import TOPICS  # noqa: E402
from tests.helpers.runs import train_run, train_text_run  # noqa: E402
from tests.helpers.specs import image_spec  # noqa: E402

QUESTIONS = ["the oven must be hot before the bread goes in", "the striker scored twice", "rain tomorrow"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_bert_dir):
    """A LoRA adapter on the tiny BERT, trained a few steps on the topics: exported merged."""
    return train_text_run(tmp_path_factory.mktemp("lora"), tiny_bert_dir, TOPICS, lora={"r": 4})


@pytest.mark.slow
def test_a_lora_classifier_exports_merged_with_parity_and_serves_through_onnxruntime(tmp_path, lora_run):
    out = tmp_path / "onnx"
    result = run_cli("export", str(lora_run), "--format", "onnx", "--out", str(out), "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == json.loads((out / "export_report.json").read_text())
    assert report["max_abs_diff"] <= 1e-4 and report["argmax_agreement"] == 1.0
    assert report["metric"]["onnx"] == report["metric"]["torch"] and report["checks"] == {
        "max_abs_diff <= 0.0001": True
    }
    assert set(report["latency_ms"]) == {"batch_1", "batch_32"} and report["examples"] > 0
    manifest = read_manifest(out)
    assert (manifest.format, manifest.kind, manifest.onnx.inputs) == (
        "onnx",
        "full",
        ["input_ids", "attention_mask"],
    )
    assert (out / "model.onnx").is_file() and (out / "tokenizer.json").is_file()  # the export stands alone

    served = load_predictor(out, device="cpu")
    original = load_predictor(lora_run, device="cpu", precision="fp32")
    assert served.backend == "onnxruntime (CPUExecutionProvider)" and served.precision.name == "fp32"
    got, expected = (p.run_batch([(None, p.check(q)) for q in QUESTIONS]) for p in (served, original))
    assert [r["label"] for r in got] == [r["label"] for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-4)


@pytest.mark.slow
def test_the_export_table_gives_latency_per_batch_and_per_sample_and_says_when_it_is_unreliable(
    tmp_path, lora_run
):
    out = tmp_path / "onnx"
    result = run_cli("export", str(lora_run), "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "export_report.json").read_text())
    shown = {}  # each table row's label: its torch and onnxruntime cells
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 3:
            shown[cells[0]] = cells[1:]
    for n in (1, 32):
        for side, cell in zip(("torch", "onnx"), shown[f"latency, batch of {n}"], strict=True):
            ms, spread, waited = (
                report[k][f"batch_{n}"][side] for k in ("latency_ms", "latency_spread", "latency_waited")
            )
            assert spread >= report["latency_drift"]  # the machine's own drift widens every spread
            if spread <= 0.15 and (waited is None or waited <= 0.2):
                assert cell == f"{ms:.3g} ms ±{spread:.0%}"
            else:  # too noisy, or the machine too busy, to trust
                assert cell.startswith(f"{ms:.3g} ms unreliable (spread ±{spread:.0%}")
    per_sample = [f"{report['latency_ms']['batch_32'][side] / 32:.3g} ms" for side in ("torch", "onnx")]
    assert shown["per sample, batch of 32"] == per_sample  # a batch's figure never reads as one sample's
    assert shown["bytes"][0].endswith(("KB", "MB")) and not shown["bytes"][0].startswith("0.0")


@pytest.mark.slow
def test_an_int8_export_is_smaller_close_in_its_metric_and_a_new_export_replaces_it(tmp_path, lora_run):
    out = tmp_path / "int8"
    manifest, _, built = export_onnx(lora_run, out, quantize="int8")
    report = measure_parity(lora_run, out, built, manifest, max_seconds=0.2)
    assert report["quantize"] == "int8" and manifest.precision == "int8"
    assert abs(report["metric"]["delta"]) <= 0.05 and report["argmax_agreement"] >= 0.9
    assert set(report["checks"]) == {"metric within 1 point", "bytes <= 0.3 x torch"}
    assert load_predictor(out, device="cpu").quantized == "int8"

    export_onnx(lora_run, out)  # an earlier export in --out is replaced, not refused
    assert read_manifest(out).onnx.quantize is None


@pytest.mark.slow
def test_an_image_cnn_exports_with_its_dynamic_batch(tmp_path):
    image = train_run(tmp_path, image_spec(tmp_path), "image")
    manifest, _, built = export_onnx(image, tmp_path / "image-onnx")
    report = measure_parity(image, tmp_path / "image-onnx", built, manifest, max_seconds=0.1)
    assert report["max_abs_diff"] <= 1e-4 and manifest.onnx.inputs == ["pixel_values"]
    module, _, _ = load_artifact(tmp_path / "image-onnx")
    assert module(torch.rand(5, *manifest.sample_shape)).shape == (5, 10)  # any batch size
    manifest, _, built = export_onnx(image, tmp_path / "image-int8", quantize="int8")
    int8 = measure_parity(image, tmp_path / "image-int8", built, manifest, max_seconds=0.1)
    assert int8["bytes"]["onnx"] < 0.7 * report["bytes"]["onnx"]  # a tiny model: the graph's own bytes weigh


@pytest.mark.slow
def test_a_causal_lm_exports_with_its_cache_and_generates_as_the_torch_model_does(tmp_path):
    gpt = {
        "name": "gpt",
        "model": {
            "source": "bundled:gpt-tiny",
            "task": "causal-lm",
            "options": {"n_layer": 2, "n_embd": 32, "n_head": 2},
        },
        "data": {"train": str(TOPICS), "text_field": "text", "max_length": 24, "eval_fraction": 0.1},
        "train": {"max_steps": 2, "batch_size": 8, "precision": "fp32"},
    }
    lm = train_run(tmp_path, gpt, "gpt")
    exported = tmp_path / "gpt-onnx"
    manifest, _, built = export_onnx(lm, exported)
    assert manifest.onnx.cache.layers == 2 and manifest.onnx.inputs[:3] == [
        "input_ids", "attention_mask", "position_ids"
    ]  # fmt: skip
    report = measure_parity(lm, exported, built, manifest, max_seconds=0.1)
    assert report["metric"]["name"] == "perplexity" and report["max_abs_diff"] <= 1e-4
    # prompts of 8 lengths, left-padded, then 8 steps each through its own cache: the logits agree at each
    assert report["decode"]["max_abs_diff"] <= 1e-4 and report["decode"]["same_token"] == 1.0
    assert all(report["checks"].values())
    module, _, _ = load_artifact(exported)
    ids = torch.randint(0, 200, (3, 7))
    assert module(ids).shape[:2] == (3, 7)  # any batch and sequence length, no cache given
    with pytest.raises(GpuforgeError, match="answers the completion routes"):
        load_predictor(exported, device="cpu")  # /predict is not for it

    answers = {}
    for model in (lm, exported):
        with TestClient(create_worker(model, ServeOptions(precision="fp32", max_batch=4))) as client:
            deadline = time.monotonic() + 60
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, client.get("/readyz").json()
                time.sleep(0.05)
            texts = []
            for prompt in ("the striker", "rain", "the oven must be hot before"):
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
                answer = client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                texts.append(answer.json()["choices"][0]["text"])
            answers[client.get("/info").json()["backend"]] = texts
            wrong = client.post("/v1/completions", json={"prompt": [5, 100_000], "max_tokens": 2})
            assert wrong.status_code == 422 and "token ids must be in" in wrong.text  # refused, not a 500
    assert answers["onnxruntime (CPUExecutionProvider)"] == answers["torch"]  # greedy: the same words


UNEXPORTABLE = """
import torch

class Bessel(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x).sum(-1, keepdim=True)  # no ONNX form in either exporter

class Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.head = torch.nn.Sequential(Bessel())

    def forward(self, x):
        x = x.flatten(1)
        return self.linear(x) + self.head(x)

def odd(num_labels, **options):
    return Odd()
"""


MASK_READ_WHEN_PADDED = """
import torch

class MaskWhenPadded(torch.nn.Module):
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab_size, 8), torch.nn.Linear(8, num_labels)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None and bool((attention_mask == 0).any()):  # a branch on the values
            h = h * attention_mask[..., None]
        return self.head(h.mean(1))

def model(vocab_size, num_labels, **options):
    return MaskWhenPadded(vocab_size, num_labels)
"""


@pytest.mark.slow
def test_a_graph_that_traced_the_mask_away_is_refused(tmp_path):
    module = tmp_path / "masked.py"
    module.write_text(MASK_READ_WHEN_PADDED)
    spec = {
        "name": "masked",
        "model": {"source": f"python:{module}:model", "task": "sequence-classification"},
        "data": {"train": str(TOPICS), "text_field": "text", "tokenizer": "bytes", "eval_fraction": 0.1},
        "train": {"max_steps": 1, "batch_size": 8, "precision": "fp32"},
    }
    run = train_run(tmp_path, spec, "masked")
    # traced on a batch without padding (torch.export refuses the branch; the TorchScript tracer keeps the
    # side it took), the graph would ignore every mask: a padded batch of another size shows it
    with pytest.raises(ExportError, match="fixed when it was traced"):
        export_onnx(run, tmp_path / "masked-onnx")
    assert not (tmp_path / "masked-onnx").exists()


@pytest.mark.slow
def test_bad_exports_are_refused_saying_what_is_wrong(tmp_path, lora_run):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="holds something other than an ONNX export"):
        export_onnx(lora_run, taken)
    assert (taken / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="opsets 14 to 21"):
        export_onnx(lora_run, tmp_path / "x", opset=9)
    with pytest.raises(ExportError, match="inside the model directory"):
        export_onnx(lora_run, lora_run / "onnx")

    module = tmp_path / "odd.py"
    module.write_text(UNEXPORTABLE)
    spec = image_spec(tmp_path, max_steps=1)
    spec["model"]["source"] = f"python:{module}:odd"
    odd = train_run(tmp_path, spec, "odd")
    with pytest.raises(ExportError, match=r"operator bessel_j0 in module head\.0, a Bessel"):
        export_onnx(odd, tmp_path / "odd-onnx")
    assert not (tmp_path / "odd-onnx").exists()

    exported = tmp_path / "fine"
    export_onnx(lora_run, exported)
    before = sorted(p.name for p in exported.iterdir())
    with pytest.raises(ExportError, match="bessel_j0"):
        export_onnx(odd, exported)  # a failed export over an earlier one leaves that one whole
    assert sorted(p.name for p in exported.iterdir()) == before and load_predictor(exported, device="cpu")
    with pytest.raises(ExportError, match="an ONNX export already"):
        export_onnx(exported, tmp_path / "again")
    with pytest.raises(GpuforgeError, match="--quantize: an ONNX export"):
        load_predictor(exported, device="cpu", quantize="int8")
    result = run_cli("export", str(lora_run), "--format", "tflite", "--out", str(tmp_path / "t"))
    assert result.returncode == 2 and "--format tflite" in result.stderr
