"""CUDA paths of the engine; skipped without CUDA, run by scripts/gpu_check.sh."""

import math

import pytest
import torch

from gpuforge.hardware.probe import select_device
from gpuforge.runs import RunDir
from gpuforge.runtime.precision import choose_precision
from gpuforge.spec import parse_spec
from gpuforge.train.engine import train
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.gpu


def test_auto_picks_cuda_and_bf16():
    device = select_device("auto")
    assert device.type == "cuda"
    assert choose_precision("auto", device).name == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


@pytest.mark.parametrize("precision", ["auto", "fp16", "fp32"])
def test_image_job_on_cuda(tmp_path, precision):
    summary = train(
        parse_spec(image_spec(tmp_path, max_steps=5, precision=precision), tmp_path), tmp_path / "run"
    )
    assert summary["device_type"] == "cuda" and math.isfinite(summary["final_loss"])
    assert summary["peak_mem_bytes"] > 0 and 0 < summary["mfu"] < 1


def test_text_classification_on_cuda_resumes_the_same_curve(tmp_path, tiny_bert_dir, small_topics):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 64},
        "train": {"max_steps": 6, "batch_size": 16, "lr": 1e-3, "checkpoint_every": 3, "precision": "bf16"},
    }
    spec = parse_spec(raw, tmp_path)
    full = train(spec, tmp_path / "full")
    assert full["device_type"] == "cuda" and full["tokens_per_s"] > 0
    stopped = train(spec, tmp_path / "run", SignalAt(3))
    assert stopped["status"] == "cancelled"
    resumed = train(spec, tmp_path / "run")
    assert resumed["resumed_from"] == 3
    mine = [m["loss"] for m in RunDir(tmp_path / "run").metrics()]
    assert mine == pytest.approx([m["loss"] for m in RunDir(tmp_path / "full").metrics()], rel=1e-3)
