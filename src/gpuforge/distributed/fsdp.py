"""FSDP2 for ``distributed.strategy: fsdp``: parameters, gradients and optimizer state split over ranks.

Every rank, after joining the process group and before making the optimizer::

    module = shard_model(module, device)                   # in place; the same object comes back
    optimizer = make_optimizer(module, ...)                # fused AdamW works on the sharded parameters
    ...
    model_sd, optim_sd = full_state_dicts(module, optimizer)  # every rank calls; rank 0 gets the dicts
    load_full_state_dicts(module, optimizer, model_sd, optim_sd)  # every rank calls; rank 0's dicts count

Choices, and why (2-rank trials on gloo, torch 2.13 CPU build):

- ``fully_shard`` (FSDP2), not the FlatParameter ``FullyShardedDataParallel``: parameters stay the module's
  own (DTensors sharded on dim 0), names are unchanged, and it runs on CPU with gloo: forward, backward, the
  gradient reduce-scatter and an optimizer step all work there, with or without a mixed precision policy.
- Units: each block of the outermost ``nn.ModuleList``/``nn.Sequential`` containers (transformer layers:
  GPT-2's ``transformer.h``, Llama's ``layers``, an MLP's layers), else the root's children, each its own
  FSDP unit, then the root for the rest. A unit is all-gathered just before its forward and freed after,
  so a rank holds one block's full weights at a time. A block that shares a parameter with a module
  outside it (tied embeddings) stays with the root: a parameter belongs to exactly one unit.
- ``mp_dtype``: the unsharded weights in that dtype (the all-gathers carry half the bytes for bf16), the
  gradients reduced in float32 (as DDP does), the sharded master weights and Adam moments in float32. It is
  optional: the loop's autocast already computes in low precision without it.
- Optimizer: any torch optimizer made after sharding; fused AdamW runs on the DTensor shards on CPU (and
  on CUDA), matching foreach's results to rounding. Each rank steps only its shard, so its moments are
  shards too; the step counters (one 0-d tensor per parameter) are whole on every rank.
- Checkpoints hold *full* tensors in the same layout as a one-process run: the model state dict with tied
  weights under one name (``safetensors.torch.save_file`` takes it as is, as ``save_model`` would write
  it), and the optimizer state keyed by parameter index, exactly ``optimizer.state_dict()``'s layout.
  A checkpoint therefore loads into any number of ranks, or into a plain model with
  ``optimizer.load_state_dict``, and a plain run's checkpoint loads into FSDP. Gathering goes through
  ``torch.distributed.checkpoint.state_dict`` (full tensors, offloaded to rank 0's CPU one at a time);
  loading broadcasts rank 0's tensors one at a time and each rank keeps its shard, so no rank but 0 ever
  holds a full copy. The model and optimizer are loaded by two calls: ``set_state_dict`` with an empty
  model dict on ranks > 0 skips the model there (its ``optim_only`` test), and rank 0 then waits in a
  broadcast that no other rank joins, until the collective timeout.
- A module that is not sharded (one process, no process group) goes through the same functions with
  plain ``state_dict``/``load_state_dict``, so the loop needs no second path.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(module: nn.Module, device: torch.device, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``module`` in place over every rank of the default process group and return it.

    ``device``: where the shards live (CPU: gloo; CUDA: NCCL, this rank's GPU). Without a process group the
    module comes back as it is."""
    if not (dist.is_available() and dist.is_initialized()):
        return module
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32 if mp_dtype else None)
    for unit in _units(module):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


def _units(module: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: see the module docstring."""
    blocks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                blocks.extend((f"{prefix}{name}.{n}", c) for n, c in child.named_children())
            else:
                visit(f"{prefix}{name}.", child)

    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        blocks = list(module.named_children())
    else:
        visit("", module)
        blocks = blocks or list(module.named_children())
    owners = _aliases(module.named_parameters(remove_duplicate=False))
    return [
        block
        for name, block in blocks
        if any(True for _ in block.parameters())
        and all(n.startswith(name + ".") for p in block.parameters() for n in owners[id(p)])
    ]


def _aliases(named: Any) -> dict[int, list[str]]:
    """Every name a tensor is reachable under, by the tensor's id (tied weights have several)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, tensor in named:
        names[id(tensor)].append(name)
    return names


def _tied_groups(module: nn.Module, keys: Any) -> list[list[str]]:
    """Groups of state dict keys that are one tensor in ``module``, sorted: the first is the one kept
    (safetensors' ``save_model`` keeps the same one)."""
    keys = set(keys)
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    groups = (sorted(n for n in names if n in keys) for names in _aliases(named).values())
    return [g for g in groups if len(g) > 1]


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dicts(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Full (unsharded) model and optimizer state dicts on CPU; every rank must call it (it all-gathers).

    Rank 0 (or a process without a process group) gets ``(model_sd, optim_sd)``: ``model_sd`` keyed like
    ``module.state_dict()`` less tied aliases, ``optim_sd`` in ``optimizer.state_dict()``'s layout (state
    by parameter index in param-group order). Other ranks get ``({}, None)``. Unsharded CPU tensors are
    the live ones, not copies: write them out before the next step."""
    if not _is_sharded(module):
        model_sd = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        optim_sd = _to_cpu(optimizer.state_dict())
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, by_name = get_state_dict(module, optimizer, options=options)
        if dist.get_rank() != 0:
            return {}, None
        # by_name: state keyed by parameter name, groups list names in the optimizer's own order
        index = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
        optim_sd = {
            "state": {index[name]: state for name, state in by_name["state"].items()},
            "param_groups": [
                {**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]
            ],
        }
    for group in _tied_groups(module, model_sd):
        for alias in group[1:]:
            del model_sd[alias]
    return model_sd, optim_sd


def load_full_state_dicts(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, torch.Tensor] | None,
    optim_sd: dict[str, Any] | None,
) -> None:
    """Load what ``full_state_dicts`` returned (or a one-process ``state_dict()`` pair), on any number of
    ranks: every rank must call it; only rank 0's dicts are read (others may pass None) and each rank keeps
    its shard. ``optimizer`` must hold the parameters in the order of the one that was saved, as with
    ``optimizer.load_state_dict``. Both dicts are left as they were."""
    sharded = _is_sharded(module)
    if sharded and dist.get_rank() != 0:
        model_sd, optim_sd = {}, {}
    else:
        assert model_sd is not None and optim_sd is not None, "rank 0 needs both state dicts"
        model_sd = dict(model_sd)
        for group in _tied_groups(module, module.state_dict()):
            present = [k for k in group if k in model_sd]
            for alias in group:
                if present and alias not in model_sd:
                    model_sd[alias] = model_sd[present[0]]
    if not sharded:
        module.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if optim_sd:  # rank 0: parameter indices to names, which is what the torch call matches on
        name_of = {id(p): n for n, p in module.named_parameters()}
        names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
        optim_sd = {
            "state": {names[i]: state for i, state in optim_sd["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]
            ],
        }
    set_model_state_dict(module, model_sd, options=options)
    set_optimizer_state_dict(module, optimizer, optim_sd, options=options)


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds at rest: its parameter shards, gradient shards (those present now) and
    optimizer state (moments as shards, plus one step counter per parameter). Unsharded weights, which
    exist only while a unit runs, are not counted. Unsharded: the whole, what every DDP rank holds."""

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    state = optimizer.state.values() if optimizer is not None else []
    return {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(v) for s in state for v in s.values() if isinstance(v, torch.Tensor)),
    }


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree
