"""FSDP2 sharding (gpuforge.distributed.fsdp) in real multi-process runs on gloo, against a plain process.

Three processes of tests/distributed/fsdp_worker.py, under a hard timeout (and a 60 s collective timeout
inside), so a hang fails the tests instead of blocking the suite:

- one plain process (no process group, no FSDP) trains each model 6 steps, the reference, checkpointing
  at step 3 as gpuforge.train.checkpoint does, then resumes from the 2-rank checkpoint of step 3;
- meanwhile two ranks train the same, sharded, and resume from their own checkpoint and the plain one;
- then the three join one group and resume, sharded 3 ways, from the 2-rank checkpoint.

A resuming run waits for the checkpoint it loads; every one must end where the uninterrupted runs end.
Models: a plain ``nn.Sequential`` MLP, a ModuleList of ``nn.TransformerEncoderLayer`` s and a tiny
``transformers`` GPT-2 (tied embeddings).
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

from gpuforge.distributed.fsdp import (
    _units,
    full_state_dicts,
    load_full_state_dicts,
    local_bytes,
    shard_model,
)
from tests.helpers.gloo_workers import run_workers

WORKER = Path(__file__).with_name("fsdp_worker.py")
JOB_TIMEOUT_S = 120
MODELS = ["mlp", "blocks", "gpt2"]
STEPS, SAVE_AT = 6, 3
# Same math in another summation order (a rank's mean, then the mean over ranks). Adam turns the rounding
# of a near-zero gradient into a visible step (1.5e-5 seen on one element of 4096); a real fault (a moment
# lost, a shard misplaced) moves parameters by ~lr = 1e-2.
ATOL = 1e-4


def _runs(path: str) -> list[dict]:
    """``w1``/``w2``: train on 1 (plain) or 2 ranks; ``wA_to_wB``: resume A's step-3 checkpoint on B."""
    if "_to_" not in path:
        return [{"model": m, "tag": f"{m}_{path}"} for m in MODELS]
    return [{"model": m, "tag": f"{m}_{path}", "resume_from": f"ckpt_{m}_{path[:2]}"} for m in MODELS]


def _phases() -> list[list[dict]]:
    """Each process's phases: the plain process, then the two ranks."""
    two, three = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    bf16 = {"model": "mlp", "tag": "mlp_w2_bf16", "mp": True}
    sharded = _runs("w2") + [bf16] + _runs("w2_to_w2") + _runs("w1_to_w2")
    return [
        [
            {"rank": 0, "world": 1, "init": "none", "runs": _runs("w1") + _runs("w2_to_w1")},
            {"rank": 2, "world": 3, "init": three, "runs": _runs("w2_to_w3")},
        ],
        *[
            [
                {"rank": r, "world": 2, "init": two, "runs": sharded},
                {"rank": r, "world": 3, "init": three, "runs": _runs("w2_to_w3")},
            ]
            for r in (0, 1)
        ],
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    out = tmp_path_factory.mktemp("fsdp")
    commands, logs = [], []
    for i, phases in enumerate(_phases()):
        logs.append(out / f"process{i}.log")
        conf = json.dumps({"steps": STEPS, "save_at": SAVE_AT, "phases": phases})
        commands.append([sys.executable, str(WORKER), str(out), conf])
    run_workers(commands, logs, JOB_TIMEOUT_S, ", in run")  # a failure past that line is the test's
    return out


def final(out: Path, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{tag}.pt")["params"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    worst = max(a, key=lambda k: (a[k].float() - b[k].float()).abs().max().item())
    diff = (a[worst].float() - b[worst].float()).abs().max().item()
    assert diff <= atol, f"{worst} differs by {diff:.3g}"


def byte_counts(out: Path, tag: str, world: int) -> list[dict[str, int]]:
    return [json.loads((out / f"{tag}_bytes{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_two_sharded_ranks_train_as_one_plain_process(out, model):
    """Parameters after 6 steps, and the gradient norm of every step, which Adam's scale invariance would
    otherwise hide: gradients summed over ranks instead of averaged would show there."""
    assert_close(final(out, f"{model}_w2"), final(out, f"{model}_w1"))
    sharded, plain = torch.load(out / f"{model}_w2.pt"), torch.load(out / f"{model}_w1.pt")
    assert sharded["norms"] == pytest.approx(plain["norms"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("path", ["w2_to_w1", "w2_to_w2", "w2_to_w3", "w1_to_w2"])
def test_resume_from_full_state_dicts_at_any_world_size(out, model, path):
    """Saved at step 3 by one world size, loaded into a differently seeded model at another, trained to step
    6: the same parameters as the run that never stopped."""
    resumed = final(out, f"{model}_{path}")
    assert_close(resumed, final(out, f"{model}_w2"))
    if path == "w2_to_w2":  # same sharding, same order of every sum: exactly the same numbers
        assert all(torch.equal(resumed[k], v) for k, v in final(out, f"{model}_w2").items())


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_checkpoints_have_the_one_process_layout(out, model):
    """What 2 ranks write holds the same names, shapes and optimizer layout as a plain run's checkpoint
    (tied GPT-2 embeddings under the one name ``safetensors.torch.save_model`` keeps)."""
    from safetensors.torch import load_file

    sharded, plain = out / f"ckpt_{model}_w2", out / f"ckpt_{model}_w1"
    a, b = load_file(str(sharded / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    if model == "gpt2":
        assert "lm_head.weight" in a and "transformer.wte.weight" not in a
    oa = torch.load(sharded / "training_state.pt")["optimizer"]
    ob = torch.load(plain / "training_state.pt")["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i, state in oa["state"].items():
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
            k: (v.shape, v.dtype) for k, v in ob["state"][i].items()
        }


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_each_of_two_ranks_holds_half(out, model):
    """Parameters, gradients and Adam moments split in two; only the step counters (4 bytes a tensor)
    are whole on every rank."""
    (whole,) = byte_counts(out, f"{model}_w1", 1)
    halves = byte_counts(out, f"{model}_w2", 2)
    for key in ("params", "grads"):
        assert sum(h[key] for h in halves) == whole[key]
        assert all(abs(h[key] / whole[key] - 0.5) < 0.02 for h in halves), (key, halves, whole)
    tensors = len(torch.load(out / f"ckpt_{model}_w1" / "training_state.pt")["optimizer"]["state"])
    counters = 4 * tensors
    assert sum(h["optimizer"] for h in halves) == whole["optimizer"] + counters
    assert all(abs(h["optimizer"] / whole["optimizer"] - 0.5) < 0.02 for h in halves)


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_float32_shards_and_tracks_float32(out):
    bf16, fp32 = torch.load(out / "mlp_w2_bf16.pt"), torch.load(out / "mlp_w2.pt")
    assert {v.dtype for v in bf16["params"].values()} == {torch.float32}
    assert byte_counts(out, "mlp_w2_bf16", 2) == byte_counts(out, "mlp_w2", 2)
    assert_close(bf16["params"], fp32["params"], atol=0.05)
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "units"),
    [
        ("mlp", ["0", "2", "3", "5"]),  # the Sequential's layers that hold parameters
        ("blocks", ["layers.0", "layers.1"]),
        ("gpt2", ["transformer.h.0", "transformer.h.1"]),  # not the tied embedding, which the root keeps
    ],
)
def test_units_are_the_blocks(out, model, units):
    assert torch.load(out / f"{model}_w2.pt")["units"] == units


class Tied(nn.Module):
    """An embedding, a body, a head tied to the embedding: GPT-2's layout in four tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


def test_a_block_sharing_a_parameter_with_the_rest_stays_with_the_root():
    module = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10))
    module[2].weight = module[0].weight
    assert _units(module) == [module[1]]
    tied = Tied()
    assert _units(tied) == list(tied.body)


def test_without_a_process_group_everything_is_plain_and_round_trips():
    """One process: shard_model leaves the module alone, the state dicts are the plain ones (tied weights
    under one name) and they load back into a fresh model and optimizer."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is up in this pytest process")
    torch.manual_seed(0)
    module = Tied()
    assert shard_model(module, torch.device("cpu")) is module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randint(0, 10, (2, 8))).square().mean().backward()
    optimizer.step()
    model_sd, optim_sd = full_state_dicts(module, optimizer)
    assert sorted(model_sd) == ["body.0.bias", "body.0.weight", "body.1.bias", "body.1.weight", "emb.weight"]
    sizes = local_bytes(module, optimizer)
    assert sizes["params"] == sizes["grads"] == sum(v.numel() * 4 for v in model_sd.values())

    fresh = Tied()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_full_state_dicts(fresh, fresh_optimizer, model_sd, optim_sd)
    assert fresh.head.weight is fresh.emb.weight
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), fresh.parameters(), strict=True))
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
