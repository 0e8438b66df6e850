"""A fraction of a GPU (issue 42), on CUDA; skipped without it, run by scripts/gpu_check.sh: the cap the
server's variables set is enforced by PyTorch's allocator (an allocation past it fails, one under it does
not); a job out of memory under its cap fails naming its fraction and the cap, never retried with smaller
micro-batches as an ordinary out-of-memory; two processes at 0.5 train on one GPU at once, and the pair's
throughput is printed against the same two one after the other (benchmarks/share.py measures the CPU)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpuforge.spec import parse_spec
from gpuforge.train.engine import train
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.gpu
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _capped(fraction: float) -> dict[str, str]:
    total = torch.cuda.get_device_properties(0).total_memory
    return {
        "GPUFORGE_CUDA_MEMORY_FRACTION": str(fraction),
        "GPUFORGE_CUDA_MEMORY_CAP": str(int(fraction * total)),
    }


ALLOCATE = """
import sys, torch
from gpuforge.runtime.device_share import cap_cuda_memory
print(cap_cuda_memory(torch.device("cuda", 0)))
total = torch.cuda.get_device_properties(0).total_memory
x = torch.empty(int(float(sys.argv[1]) * total), dtype=torch.uint8, device="cuda")
print("allocated", x.numel())
"""


def test_the_cap_is_enforced_on_what_pytorch_allocates():
    env = {**os.environ, **_capped(0.25), "PYTHONPATH": SRC}
    under = subprocess.run([sys.executable, "-c", ALLOCATE, "0.15"], env=env, capture_output=True, text=True)
    assert under.returncode == 0 and "allocated" in under.stdout, under.stderr
    assert "memory cap" in under.stdout and "0.25 of the GPU" in under.stdout
    over = subprocess.run([sys.executable, "-c", ALLOCATE, "0.35"], env=env, capture_output=True, text=True)
    assert over.returncode != 0 and "OutOfMemoryError" in over.stderr, over.stderr


def test_a_job_out_of_memory_under_its_cap_fails_naming_it_and_is_not_retried(tmp_path, monkeypatch):
    for name, value in _capped(0.5).items():
        monkeypatch.setenv(name, value)
    spec = image_spec(tmp_path, max_steps=3, batch_size=32, options={"oom_above": 8})
    summary = train(parse_spec({**spec, "resources": {"device_type": "cuda"}}, tmp_path), tmp_path / "run")
    assert summary["status"] == "failed" and "over its memory cap of" in summary["reason"], summary
    assert "(resources.devices 0.5 of the GPU)" in summary["reason"]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("kind") == "retry"]  # no smaller micro-batch was tried


def _run_pair(tmp_path: Path, name: str, together: bool, env: dict) -> float:
    """Two trainings of the same spec, at once or one after the other; wall seconds."""
    spec = image_spec(tmp_path, max_steps=300, batch_size=256, log_every=50)
    spec["resources"] = {"device_type": "cuda"}
    path = write_spec(tmp_path / f"{name}.yaml", spec)
    command = [sys.executable, "-m", "gpuforge", "train", str(path), "--out"]
    started = time.perf_counter()
    if together:
        runs = [subprocess.Popen([*command, str(tmp_path / f"{name}-{i}")], env=env) for i in range(2)]
        assert all(r.wait() == 0 for r in runs)
    else:
        for i in range(2):
            assert subprocess.run([*command, str(tmp_path / f"{name}-{i}")], env=env).returncode == 0
    return time.perf_counter() - started


def test_two_half_gpu_jobs_train_at_once_and_the_pair_is_timed_against_serial(tmp_path):
    shared = {**os.environ, **_capped(0.5), "PYTHONPATH": SRC, "GPUFORGE_DEVICE_SHARE": "0.5"}
    whole = {**os.environ, "PYTHONPATH": SRC}
    serial = _run_pair(tmp_path, "serial", together=False, env=whole)
    pair = _run_pair(tmp_path, "pair", together=True, env=shared)
    said = (
        f"gpu_share: two jobs at 0.5 together {pair:.1f} s, one after the other {serial:.1f} s, "
        f"ratio {pair / serial:.2f} ({torch.cuda.get_device_name(0)})"
    )
    print(said)  # scripts/gpu_check.sh's summary shows it (its $OUT)
    Path(os.environ.get("OUT", tmp_path), "gpu_share.txt").write_text(said + "\n")
    for i in range(2):
        done = json.loads((tmp_path / f"pair-{i}" / "summary.json").read_text())
        assert done["status"] == "finished" and done["peak_mem_bytes"] > 0
