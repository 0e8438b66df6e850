"""Where this process stands in a distributed job, and the few collectives the training loop needs.

A job launched by torchrun's elastic agent (launch/job.py) or by Ray actors (ray_launch.py) finds
its rank in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A plain
`gpuforge train` has none of them: world 1, every call here a no-op, so the loop reads the same both ways.

The loop keeps every rank on the same path: each step's decisions (NaN loss, a stop signal, the budget)
are taken from one all-reduce, so no rank breaks out of the loop while another waits in a collective.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpuforge.settings import current


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    restart: int = 0  # which attempt of the job this is (0: the first; the launcher counts)
    launched: bool = False  # started by a launcher (even as its only process), not by a plain train

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @classmethod
    def from_env(cls) -> Ranks:
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        restart = current(env).restart  # our launcher's count, else torchrun's own
        return cls(
            rank=int(env["RANK"]),
            world=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)) if restart is None else restart,
            launched=True,
        )

    def start(self, device: torch.device, timeout_s: float) -> None:
        """Join the process group: NCCL between GPUs, gloo otherwise. A collective that waits longer than
        `timeout_s` raises, so a rank that hangs or vanishes fails the job instead of stalling it."""
        if self.distributed or not dist.is_available():
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )

    def stop(self) -> None:
        if self.distributed:
            leave_process_group(peers_done=False)  # train() ended here: rank.py met the others first

    def share(self, indices: list[int]) -> list[int]:
        """This rank's slice of a global batch: strided, so shares differ by one example at most."""
        return indices[self.rank :: self.world] if self.world > 1 else indices

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Each value summed over the ranks (float64: sample counts and flags stay exact)."""
        if not self.distributed:
            return values
        # NCCL reduces device tensors only; gloo, host ones
        tensor = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(tensor)
        return tensor.tolist()

    def minimum(self, value: float, device: torch.device) -> float:
        """The smallest of the ranks' values."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.item()

    def gather(self, obj):
        """Every rank's `obj`, in rank order, on every rank (pickled: small things only)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def leave_process_group(peers_done: bool = True) -> None:
    """Tear this process's group down, every gloo process the same way (product and tests). A gloo peer
    that closes its pairs while another still uses them aborts that one ("terminate called without an
    active exception"), and a barrier alone does not prevent it: it returns on one rank while a peer may
    still be finishing it. So with `peers_done` (every rank got this far): a barrier, then every rank but 0
    leaves and says so in the group's store (a connection apart from gloo's pairs), and rank 0, which holds
    the store, leaves last, once all have said so (or after LEAVE_WAIT)."""
    if not (dist.is_available() and dist.is_initialized()):  # without distributed, no is_initialized
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _default_store() if peers_done and world > 1 else None
    try:
        if peers_done:
            dist.barrier()
            if store is not None and rank == 0:
                _wait_for_the_others(store, world)
    finally:
        dist.destroy_process_group()
    if store is not None and rank != 0:
        try:
            store.set(f"{LEFT_KEY}/{rank}", "1")
        except Exception:  # rank 0 went already (its wait ran out): nothing left to tell
            pass


def _wait_for_the_others(store, world: int) -> None:
    try:
        store.wait([f"{LEFT_KEY}/{r}" for r in range(1, world)], LEAVE_WAIT)
    except Exception:  # one of them died on its way out, or is slow: rank 0 leaves all the same
        pass


LEFT_KEY = "gpuforge/left"  # in the group's store: this rank has left the group
LEAVE_WAIT = datetime.timedelta(seconds=30)


def _default_store():
    """The store the default group rendezvoused through; None where torch does not say."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
