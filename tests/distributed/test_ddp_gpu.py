"""DDP and FSDP jobs on CUDA with NCCL, launched as `gpuforge train` launches them: one rank a GPU (one
rank when the machine has one GPU: NCCL will not put two on it, but the NCCL path and the hooks still run).

Run by scripts/gpu_check.sh (pytest -m gpu); skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from gpuforge.launch.job import launch_local
from gpuforge.runs import RunDir
from gpuforge.spec import parse_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "distributed",
    [
        {"strategy": "ddp", "gradient_compression": "none"},
        {"strategy": "ddp", "gradient_compression": "bf16"},
        {"strategy": "ddp", "gradient_compression": "powersgd"},
        {"strategy": "fsdp"},
    ],
    ids=lambda d: "-".join(d.values()),
)
def test_a_job_on_every_gpu_with_nccl(tmp_path, distributed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    devices = min(2, torch.cuda.device_count())
    spec = parse_spec(
        {
            "name": "gpt-nccl",
            "model": {
                "source": "bundled:gpt-tiny",
                "task": "causal-lm",
                "options": {"n_layer": 2, "n_embd": 128},
            },
            "data": {"train": "stdlib:docstrings", "max_length": 64, "max_records": 2000},
            "train": {"max_steps": 20, "batch_size": 16, "lr": 1e-3, "checkpoint_every": 10},
            "resources": {"devices": devices, "device_type": "cuda"},
            "distributed": distributed,
        },
        tmp_path,
    )
    summary = launch_local(spec, tmp_path / "run")
    assert summary["status"] == "finished" and summary["processes"] == devices
    assert summary["device_type"] == "cuda"
    metrics = RunDir(tmp_path / "run").metrics()
    assert [m["step"] for m in metrics] == list(range(1, 21))
    if distributed["strategy"] == "ddp":
        assert all(m["comm_bytes"] > 0 for m in metrics)
        if distributed["gradient_compression"] == "bf16":
            assert metrics[-1]["comm_bytes"] * 2 == metrics[-1]["comm_bytes_uncompressed"]
