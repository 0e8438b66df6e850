"""Gradient compression hooks (gpuforge.distributed.grad_compression) in real DDP runs on gloo.

The multi-process cases share one 2-rank job (tests/distributed/ddp_worker.py, one process group, every run
from the same seed), run under a hard timeout: a hang fails the tests instead of blocking the suite.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpuforge.distributed.grad_compression import KINDS, CommCounter, _orthogonalize, _plan, make_hook
from gpuforge.distributed.ranks import leave_process_group
from tests.helpers.gloo_workers import run_workers

WORKER = Path(__file__).with_name("ddp_worker.py")
JOB_TIMEOUT_S = 150
REGRESSOR_STEPS = 200  # enough for PowerSGD's error feedback to catch up: ~2% from `none` here, ~7% at 100

RUNS = [
    # 256-wide regressor (three 256 x 256 matrices) in 3 buckets: where torch's PowerSGD breaks on gloo
    *[
        {"kind": k, "model": "regressor", "steps": REGRESSOR_STEPS, "lr": 0.05, "bucket_cap_mb": 0.25}
        for k in KINDS
    ],
    *[{"kind": k, "model": "transformer", "steps": 20, "lr": 0.05, "bucket_cap_mb": 0.01} for k in KINDS],
    *[{"kind": k, "model": "odd", "steps": 20, "lr": 0.05, "bucket_cap_mb": 0.01} for k in KINDS],
    {"kind": "powersgd", "model": "vectors", "steps": 10, "lr": 0.05},
    # The same PowerSGD job again, over other bucket layouts: no hang, no mismatch, same numbers.
    *[
        {"kind": "powersgd", "model": "regressor", "steps": 30, "lr": 0.05, "bucket_cap_mb": mb, "repeat": i}
        for i, mb in enumerate([25, 0.25, 25, 0.25])
    ],
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp_job(
    runs: list[dict], out_dir: Path, world: int = 2, timeout: float = JOB_TIMEOUT_S
) -> list[dict]:
    """Run ``runs`` on ``world`` gloo ranks on 127.0.0.1; kill them and fail if they outlast ``timeout``."""
    out = out_dir / "results.json"
    init = f"tcp://127.0.0.1:{_free_port()}"
    commands = [
        [sys.executable, str(WORKER), str(r), str(world), init, str(out), json.dumps(runs)]
        for r in range(world)
    ]
    run_workers(commands, [out_dir / f"rank{r}.log" for r in range(world)], timeout, "train(")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple, dict]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    done = run_ddp_job(RUNS, tmp_path_factory.mktemp("ddp"))
    return {(r["kind"], r["model"], r.get("repeat")): r for r in done}


def per_step(result: dict, key: str) -> int:
    values = {s[key] for s in result["steps_comm"]}
    assert len(values) == 1, f"{key} varies between steps: {values}"
    return values.pop()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["regressor", "transformer", "odd"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_ends_with_the_same_parameters(results, kind, model):
    r = results[(kind, model, None)]
    assert r["ranks_equal"] and r["finite"]
    assert r["eval_loss"] < r["initial_loss"]


@pytest.mark.slow
def test_bytes_per_step(results):
    none, fp16, bf16, psgd = (results[(k, "regressor", None)] for k in KINDS)
    raw = per_step(none, "comm_bytes_uncompressed")
    assert raw == sum(
        4 * p for p in (256 * 256 + 256, 256 * 256 + 256, 256 * 256 + 256, 256 * 16 + 16, 2 * 256)
    )
    assert per_step(none, "comm_bytes") == raw
    for r in (fp16, bf16, psgd):
        assert per_step(r, "comm_bytes_uncompressed") == raw
    assert per_step(fp16, "comm_bytes") == raw // 2
    assert per_step(bf16, "comm_bytes") == raw // 2
    assert raw / per_step(psgd, "comm_bytes") >= 20
    # after DDP rebuilds its buckets at step 1 (the first step runs in one): 2 all-reduces per bucket
    assert psgd["steps_comm"][-1]["comm_buckets"] == 3 and psgd["steps_comm"][-1]["comm_collectives"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp16", "bf16", "powersgd"])
def test_final_loss_within_5_percent_of_none(results, kind):
    none = results[("none", "regressor", None)]
    r = results[(kind, "regressor", None)]
    assert (
        none["eval_loss"] < none["initial_loss"] / 5
    )  # the task is learned, so the comparison means something
    assert r["eval_loss"] <= 1.05 * none["eval_loss"], (r["eval_loss"], none["eval_loss"])


@pytest.mark.slow
def test_odd_shapes_and_vectors_only(results):
    vectors = results[("powersgd", "vectors", None)]
    assert vectors["ranks_equal"] and vectors["eval_loss"] < vectors["initial_loss"]
    # nothing to compress: one plain all-reduce of the bucket
    assert per_step(vectors, "comm_bytes") == per_step(vectors, "comm_bytes_uncompressed")
    odd = results[("powersgd", "odd", None)]
    assert per_step(odd, "comm_bytes") < per_step(odd, "comm_bytes_uncompressed")  # the 16 x 256 one is


@pytest.mark.slow
def test_repeated_powersgd_runs_agree_over_bucket_layouts(results):
    repeats = [results[("powersgd", "regressor", i)] for i in range(4)]
    assert all(r["ranks_equal"] for r in repeats)
    # per-tensor compression: the bucket layout changes the collectives, never the numbers
    assert len({r["eval_loss"] for r in repeats}) == 1
    assert [r["steps_comm"][-1]["comm_buckets"] for r in repeats] == [1, 3, 1, 3]


# In-process checks: one gloo rank, no network.


@pytest.fixture
def single_rank_group():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    leave_process_group()


def test_powersgd_error_feedback_loses_nothing(single_rank_group):
    """With error feedback, what was applied plus the error left equals the sum of the raw gradients."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)))
    ddp.module.load_state_dict(plain.state_dict())
    hook, state = make_hook("powersgd", rank=2)
    ddp.register_comm_hook(state, hook)
    raw_sum = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    applied_sum = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for step in range(5):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        for m, sums in ((plain, raw_sum), (ddp, applied_sum)):
            m.zero_grad()
            m(x).square().mean().backward()
            for (n, _), p in zip(plain.named_parameters(), m.parameters(), strict=True):
                sums[n] += p.grad
        counts = state.counter.pop()
        assert counts["comm_bytes"] < counts["comm_bytes_uncompressed"]
    params = dict(ddp.module.named_parameters())
    for n in raw_sum:
        mem = state.memory.get(id(params[n]))
        left = mem.error.view_as(params[n]) if mem else 0
        torch.testing.assert_close(applied_sum[n] + left, raw_sum[n], rtol=1e-4, atol=1e-5)
    assert state.memory  # the 64 x 64 weight was compressed


def test_powersgd_start_iter_sends_plain_buckets_first(single_rank_group):
    ddp = DDP(nn.Linear(128, 128))
    hook, state = make_hook("powersgd", rank=4, start_iter=2)
    ddp.register_comm_hook(state, hook)
    sent = []
    for _ in range(4):
        ddp(torch.randn(4, 128)).sum().backward()
        c = state.counter.pop()
        sent.append(c["comm_bytes"] / c["comm_bytes_uncompressed"])
    assert sent[:2] == [1.0, 1.0] and all(s < 0.2 for s in sent[2:])


def test_plan_compresses_only_matrices_worth_it():
    _, state = make_hook("powersgd", rank=4)
    grads = [
        torch.zeros(()),
        torch.zeros(256),
        torch.zeros(256, 256),
        torch.zeros(8, 1, 3, 3),  # 8 x 9: (8 + 9) * 4 * 2 > 72
        torch.zeros(16, 8, 32),  # 16 x 256
        torch.zeros(1, 300),
        torch.zeros(2, 2),
    ]
    assert _plan(state, grads) == [None, None, (256, 256, 4), None, (16, 256, 4), None, None]


def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns_finite():
    m = torch.randn(50, 4)
    _orthogonalize(m, 1e-8)
    torch.testing.assert_close(m.T @ m, torch.eye(4), atol=1e-5, rtol=0)
    z = torch.zeros(10, 3)
    _orthogonalize(z, 1e-8)
    assert torch.isfinite(z).all()


def test_make_hook_validates_its_arguments():
    with pytest.raises(ValueError, match="gradient_compression"):
        make_hook("int8")
    with pytest.raises(ValueError, match="powersgd_rank"):
        make_hook("powersgd", rank=0)


def test_counter_pop_resets():
    c = CommCounter()
    c.bucket(torch.zeros(10))
    c.all_reduce(10, torch.float16)
    assert c.pop() == {
        "comm_bytes": 20,
        "comm_bytes_uncompressed": 40,
        "comm_collectives": 1,
        "comm_buckets": 1,
    }
    assert c.pop()["comm_bytes"] == 0
