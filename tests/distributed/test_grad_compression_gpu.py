"""The compression hooks on CUDA with NCCL: one rank (NCCL will not put two ranks on one GPU), CUDA futures.

Run by scripts/gpu_check.sh (pytest -m gpu); skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpuforge.distributed.grad_compression import KINDS, make_hook

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group():
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        pytest.skip("needs CUDA and NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_hook_on_nccl_matches_plain_gradients(nccl_group, kind):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.LayerNorm(256), nn.Linear(256, 16)).cuda()
    ddp = DDP(copy.deepcopy(plain), device_ids=[0], bucket_cap_mb=0.25)
    hook, state = make_hook(kind, rank=4)
    ddp.register_comm_hook(state, hook)
    names = [n for n, _ in plain.named_parameters()]
    raw_sum = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    applied_sum = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for step in range(6):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, sums in ((plain, raw_sum), (ddp, applied_sum)):
            m.zero_grad()
            m(x).square().mean().backward()
            for n, p in zip(names, m.parameters(), strict=True):
                sums[n] += p.grad
        counts = state.counter.pop()
        ratio = counts["comm_bytes_uncompressed"] / counts["comm_bytes"]
        assert ratio == {"none": 1, "fp16": 2, "bf16": 2}.get(kind, ratio)
    torch.cuda.synchronize()
    params = dict(ddp.module.named_parameters())
    for n in names:
        if kind == "powersgd":  # error feedback: applied + error left == raw, exactly up to rounding
            mem = state.memory.get(id(params[n]))
            left = mem.error.view_as(params[n]) if mem else 0
            torch.testing.assert_close(applied_sum[n] + left, raw_sum[n], rtol=1e-4, atol=1e-5)
        else:
            tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[kind]
            torch.testing.assert_close(
                applied_sum[n], raw_sum[n], rtol=tol, atol=tol * raw_sum[n].abs().max()
            )
    if kind == "powersgd":
        assert ratio >= 10 and state.memory
