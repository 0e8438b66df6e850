"""One rank of a small DDP job on gloo, for tests/distributed (not collected by pytest).

python tests/distributed/ddp_worker.py RANK WORLD INIT_METHOD OUT_JSON CONFIG_JSON

CONFIG_JSON is a list of runs, ``{"kind", "model", "steps", "rank", "bucket_cap_mb", "lr", "start_iter"}``,
trained one after the other in one process group, each from the same seed. Rank 0 writes, per run: the final
loss on a fixed held-out batch, the bytes counted per step, whether every rank ended with the same parameters.
A kind ``torch:fp16|bf16|powersgd|batched_powersgd`` registers torch's own hook instead (rank 4, PowerSGD from
step 2), to reproduce what the module docstring of gpuforge.distributed.grad_compression says of them on gloo.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpuforge.distributed.grad_compression import make_hook
from gpuforge.distributed.ranks import leave_process_group

IN, OUT = 256, 16


class Regressor(nn.Module):
    """256-wide MLP (three 256x256 matrices) with biases and a LayerNorm: 2-D and 1-D parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, 256),
            nn.Tanh(),
            nn.LayerNorm(256),
            nn.Linear(256, 256),
            nn.Tanh(),
            nn.Linear(256, 256),
            nn.Tanh(),
            nn.Linear(256, OUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyTransformer(nn.Module):
    """Embedding, one encoder layer (attention, MLP, LayerNorms), a head: transformer-ish parameter shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)).mean(1))


class OddShapes(nn.Module):
    """0-D and 1-D parameters, 3-D ones (one big enough to compress), a conv, a 1 x 300 row, a 2 x 2."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.bias = nn.Parameter(torch.zeros(IN))
        self.cube = nn.Parameter(torch.randn(3, 5, 7) * 0.1)
        self.mix = nn.Parameter(torch.randn(OUT, 8, 32) * 0.05)  # viewed as 16 x 256: compressed
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.row = nn.Parameter(torch.randn(1, 300) * 0.1)
        self.tiny = nn.Parameter(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * self.scale + self.bias)  # (B, 256)
        img = self.conv(h.view(-1, 1, 16, 16)).mean((2, 3))  # (B, 8)
        extra = 0.01 * (self.cube.sum() + self.row.sum() + self.tiny.trace())
        mixed = torch.einsum("bij,kij->bk", h.view(-1, 8, 32), self.mix)
        return mixed + (img[:, :2] @ self.tiny).repeat(1, OUT // 2) + extra


class OnlyVectors(nn.Module):
    """1-D parameters only (nothing PowerSGD can compress)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(IN) * 0.1)
        self.b = nn.Parameter(torch.zeros(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).view(x.shape[0], OUT, -1).sum(-1) + self.b


MODELS = {"regressor": Regressor, "transformer": TinyTransformer, "odd": OddShapes, "vectors": OnlyVectors}


def teacher() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(IN, 32, generator=g) / IN**0.5, torch.randn(32, OUT, generator=g) / 32**0.5


def batch(model: str, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic regression task: the target is a fixed random 2-layer teacher (or a token mean)."""
    g = torch.Generator().manual_seed(seed)
    if model == "transformer":
        x = torch.randint(0, 64, (size, 12), generator=g)
        return x, x.float().mean(1, keepdim=True) / 32 - 1
    x = torch.randn(size, IN, generator=g)
    a, b = teacher()
    return x, torch.tanh(x @ a) @ b


def torch_hook(name: str, rank: int) -> tuple:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("fp16", "bf16"):
        return None, getattr(default_hooks, f"{name}_compress_hook")
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    return state, powerSGD_hook.powerSGD_hook if name == "powersgd" else powerSGD_hook.batched_powerSGD_hook


def train(run: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = DDP(MODELS[run["model"]](), bucket_cap_mb=run.get("bucket_cap_mb", 25))
    if run["kind"].startswith("torch:"):
        state = None
        model.register_comm_hook(*torch_hook(run["kind"].removeprefix("torch:"), run.get("rank", 4)))
    else:
        hook, state = make_hook(
            run["kind"],
            None,
            rank=run.get("rank", 4),
            start_iter=run.get("start_iter", 0),
            seed=run.get("seed", 0),
        )
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=run.get("lr", 0.1), momentum=0.9)
    x_eval, y_eval = batch(run["model"], 999_999, size=512)
    with torch.no_grad():
        initial_loss = nn.functional.mse_loss(model.module(x_eval), y_eval).item()
    steps = []
    t0 = time.perf_counter()
    for step in range(run["steps"]):
        x, y = batch(run["model"], 1000 * step + rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps.append(state.counter.pop() if state else {})
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model.module(x_eval), y_eval).item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        **run,
        "initial_loss": initial_loss,
        "eval_loss": eval_loss,
        "finite": bool(torch.isfinite(flat).all()),
        "ranks_equal": all(torch.equal(gathered[0], t) for t in gathered[1:]),
        "steps_comm": steps,
        "seconds": elapsed,
    }


def main(argv: list[str]) -> None:
    rank, world, init, out, config = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    done = False
    try:
        results = [train(run, rank, world) for run in json.loads(config)]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        done = True
    finally:
        leave_process_group(peers_done=done)


if __name__ == "__main__":
    main(sys.argv[1:])
