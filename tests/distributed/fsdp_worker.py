"""One process of the small FSDP jobs on gloo in tests/distributed/test_fsdp.py (not collected by pytest).

python tests/distributed/fsdp_worker.py OUT_DIR CONFIG_JSON

CONFIG_JSON: ``{"steps": S, "save_at": K, "phases": [{"rank", "world", "init", "runs": [...]}, ...]}``. A
process goes through its phases in order, each in its own process group (``init`` a tcp:// address), or in
none with ``init`` ``none``: a plain one-process run, which saves and loads checkpoints the way
gpuforge.train.checkpoint does (``safetensors.torch.save_model``/``load_model``, ``optimizer.state_dict()``/
``load_state_dict``). In a group the model is sharded with ``shard_model`` and checkpoints go through
``full_state_dicts``/``load_full_state_dicts`` (safetensors and torch.save on rank 0). Leaving a group and
joining a bigger one lets 3 processes serve worlds of 1, 2 and 3 (each start costs seconds of imports).

A run, ``{"model", "tag", "mp", "resume_from"}``, trains ``model`` (seed 0) for S steps and writes its
checkpoint at step K to ``OUT_DIR/ckpt_{tag}``; with ``resume_from`` (a checkpoint directory name) it builds
the model from another seed, waits for that checkpoint (another process may still be writing it), loads it
and trains steps K+1..S. At the end rank 0 writes ``OUT_DIR/{tag}.pt``: the final full state dict, its own
losses, the global gradient norms, the FSDP units; after its first step every rank writes
``OUT_DIR/{tag}_bytes{rank}.json`` (``local_bytes``).

Every step draws a global batch of 12 from the step's seed; each rank takes rows rank::world, as two
micro-batches with the gradient sync held back on the first (as gpuforge's loop does), so any world size in
(1, 2, 3) follows the same mean loss over the same 12 rows.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from torch.distributed.fsdp import FSDPModule

from gpuforge.distributed.fsdp import full_state_dicts, load_full_state_dicts, local_bytes, shard_model
from gpuforge.distributed.ranks import leave_process_group

GLOBAL_BATCH, MICRO, VOCAB, SEQ = 12, 2, 50, 8


class Blocks(nn.Module):
    """Embedding, a ModuleList of two encoder layers (attention, MLP, LayerNorms), an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(16, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
        )
    if name == "blocks":
        return Blocks()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """As gpuforge.train.engine.make_optimizer: decay on matrices only, fused AdamW. eps 1e-6, not 1e-8:
    some gradients are zero but for rounding (the attention key biases: softmax ignores a shift shared by
    all keys), and Adam would scale that noise, which differs with the reduction order, to whole steps."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-6, fused=True)


def loss_of(name: str, module: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "mlp":
        return nn.functional.mse_loss(module(rows["x"]).float(), rows["y"])
    if name == "blocks":
        logits = module(rows["ids"][:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows["ids"][:, 1:].reshape(-1))
    return module(input_ids=rows["ids"], labels=rows["ids"]).loss


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return {
        "x": x,
        "y": torch.sin(x[:, :4] * 2) + x[:, 4:8],
        "ids": torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
    }


def train_step(
    name: str, module: nn.Module, optimizer, step: int, rank: int, world: int
) -> tuple[float, float]:
    """One optimizer step; this rank's loss and the global gradient norm (as the loop's clipping sees it)."""
    mine = {k: v[rank::world] for k, v in batch(step).items()}
    n = len(mine["x"]) // MICRO
    sharded = world > 1
    total = 0.0
    for i in range(MICRO):
        if sharded:
            module.set_requires_gradient_sync(i == MICRO - 1)
        loss = loss_of(name, module, {k: v[i * n : (i + 1) * n] for k, v in mine.items()}) / MICRO
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1e9)  # sharded: a replicated DTensor
    optimizer.step()
    return total, float(norm)


def save(module: nn.Module, optimizer, path: Path, rank: int, plain: bool) -> None:
    """Write a checkpoint under a temporary name and rename it into place: readers wait for ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    if plain:  # as gpuforge.train.checkpoint in one process
        tmp.mkdir()
        save_model(module, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict()}, tmp / "training_state.pt")
        tmp.rename(path)
        return
    model_sd, optim_sd = full_state_dicts(module, optimizer)
    if rank == 0:
        tmp.mkdir()
        save_file(model_sd, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optim_sd}, tmp / "training_state.pt")
        tmp.rename(path)


def wait_for(path: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def run(spec: dict, conf: dict, rank: int, world: int, plain: bool, out: Path) -> None:
    name, tag = spec["model"], spec["tag"]
    resume = spec.get("resume_from")
    module = build(name, seed=1 if resume else 0)
    if not plain:
        shard_model(module, torch.device("cpu"), torch.bfloat16 if spec.get("mp") else None)
    optimizer = make_optimizer(module)
    first = 1
    if resume:
        ckpt = out / resume
        wait_for(ckpt)
        if plain:  # as gpuforge.train.checkpoint in one process
            load_model(module, str(ckpt / "model.safetensors"))
            optimizer.load_state_dict(torch.load(ckpt / "training_state.pt")["optimizer"])
        else:
            model_sd = load_file(str(ckpt / "model.safetensors")) if rank == 0 else None
            optim_sd = torch.load(ckpt / "training_state.pt")["optimizer"] if rank == 0 else None
            load_full_state_dicts(module, optimizer, model_sd, optim_sd)
        first = conf["save_at"] + 1
    losses, norms = [], []
    for step in range(first, conf["steps"] + 1):
        loss, norm = train_step(name, module, optimizer, step, rank, world)
        losses.append(loss)
        norms.append(norm)
        if step == first:
            (out / f"{tag}_bytes{rank}.json").write_text(json.dumps(local_bytes(module, optimizer)))
        optimizer.zero_grad(set_to_none=True)
        if step == conf["save_at"] and not resume:
            save(module, optimizer, out / f"ckpt_{tag}", rank, plain)
    final, _ = full_state_dicts(module, optimizer)
    if rank == 0:
        units = [n for n, m in module.named_modules() if isinstance(m, FSDPModule) and n]
        torch.save({"params": final, "losses": losses, "norms": norms, "units": units}, out / f"{tag}.pt")


def main(argv: list[str]) -> None:
    out, conf = Path(argv[1]), json.loads(argv[2])
    torch.set_num_threads(1)
    for phase in conf["phases"]:
        rank, world, plain = phase["rank"], phase["world"], phase["init"] == "none"
        if plain:
            for spec in phase["runs"]:
                run(spec, conf, rank, world, plain, out)
            continue
        timeout = datetime.timedelta(seconds=60)  # a collective waiting longer raises
        dist.init_process_group(
            "gloo", init_method=phase["init"], rank=rank, world_size=world, timeout=timeout
        )
        peers_done = False
        try:
            for spec in phase["runs"]:
                run(spec, conf, rank, world, plain, out)
            peers_done = True
        finally:  # also after a failed run: a group left up at exit aborts the process, hiding the error
            leave_process_group(peers_done=peers_done)


if __name__ == "__main__":
    main(sys.argv)
