"""Checkpoints: weights (safetensors), optimizer, scheduler, loss scale, RNG states and the data position.

A checkpoint directory is written under a temporary name and renamed into place, and its meta.json is
written last, so a process killed mid-save leaves either a whole checkpoint or none.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from gpuforge.runs import RunDir
from gpuforge.runtime.precision import MixedPrecision


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an adapter run saves: trainable parameters and buffers; the frozen base rebuilds from source."""
    keep = {n for n, p in module.named_parameters() if p.requires_grad} | {
        n for n, _ in module.named_buffers()
    }
    # state_dict leaves out non-persistent buffers (position ids) that load_state_dict would not take back
    return {n: t.detach().contiguous() for n, t in module.state_dict().items() if n in keep}


def save_checkpoint(
    run: RunDir,
    step: int,
    module: torch.nn.Module,
    optimizer,
    scheduler,
    amp: MixedPrecision,
    meta: dict[str, Any],
    keep: int,
    adapter: bool = False,
    rng_ranks: list[dict[str, Any]] | None = None,
    full_states: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
) -> Path:
    """`rng_ranks`: every rank's RNG state, in rank order, for a distributed job (rank 0 writes them).
    `full_states`: the model's and optimizer's state gathered from sharded ranks (FSDP), written in place
    of the module's and optimizer's own, in the same layout as a one-process run."""
    final = run.checkpoint_path(step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if full_states is not None:
        save_file(full_states[0], str(tmp / "model.safetensors"))
    elif adapter:
        save_file(trainable_state(module), str(tmp / "adapter.safetensors"))
    else:
        save_model(module, str(tmp / "model.safetensors"))  # handles tied weights (shared tensors)
    torch.save(
        {
            "optimizer": full_states[1] if full_states is not None else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": amp.state_dict(),
            "rng": rng_state(),
            "rng_ranks": rng_ranks,
        },
        tmp / "training_state.pt",
    )
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for _, old in run.checkpoints()[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: Path,
    module: torch.nn.Module,
    optimizer,
    scheduler,
    amp: MixedPrecision,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    sharded: bool = False,
) -> dict[str, Any]:
    """Restore everything saved by save_checkpoint; returns its meta (step, data position, cost so far).

    Each rank of a distributed job restores its own RNG state when the checkpoint was written by as many
    ranks; with another number, ranks past 0 keep the seeds they started with (their data slices differ
    from the old ones anyway). `sharded` (FSDP): rank 0 reads the full states and every rank keeps its
    shard of them; every rank must call it."""
    state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    if sharded:
        from gpuforge.distributed.fsdp import load_full_state_dicts

        model_state = load_file(str(path / "model.safetensors")) if rank == 0 else None
        load_full_state_dicts(module, optimizer, model_state, state["optimizer"] if rank == 0 else None)
    elif (path / "adapter.safetensors").exists():
        adapter = load_file(str(path / "adapter.safetensors"), device=str(device))
        unexpected = module.load_state_dict(adapter, strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"checkpoint {path} holds weights this model lacks: {unexpected[:5]}")
    else:
        load_model(module, str(path / "model.safetensors"), device=str(device))
    if not sharded:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    amp.load_state_dict(state["scaler"])
    saved_ranks = state.get("rng_ranks")
    if saved_ranks and len(saved_ranks) == world:
        set_rng_state(saved_ranks[rank])
    elif rank == 0:
        set_rng_state(state["rng"])
    return read_meta(path)


def save_weights(path: Path, module: torch.nn.Module, adapter: bool = False) -> None:
    """The weights alone (an adapter run: its trainable part), written under a temporary name and renamed:
    keep_best's copy of the best evaluation's model."""
    tmp = path.with_name(path.name + ".tmp")
    if adapter:
        save_file(trainable_state(module), str(tmp))
    else:
        save_model(module, str(tmp))
    tmp.rename(path)


def load_weights(path: Path, module: torch.nn.Module, device: torch.device, adapter: bool = False) -> None:
    """Weights that save_weights wrote, back into `module`."""
    if adapter:
        module.load_state_dict(load_file(str(path), device=str(device)), strict=False)
    else:
        load_model(module, str(path), device=str(device))


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json: its step, data position, micro-batch, precision and cost so far."""
    return json.loads((path / "meta.json").read_text())
