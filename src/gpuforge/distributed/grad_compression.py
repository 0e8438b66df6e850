"""Gradient compression for data-parallel training: DDP communication hooks that work on gloo and NCCL.

Every rank, after wrapping the model in DDP and before the first backward::

    hook, state = make_hook(spec.distributed.gradient_compression, process_group=None, rank=4)
    ddp_model.register_comm_hook(state, hook)
    ...
    loss.backward(); optimizer.step()
    record.update(state.counter.pop())  # {"comm_bytes": ..., "comm_bytes_uncompressed": ..., ...}

Kinds (``KINDS``):

- ``none``: plain all-reduce of each bucket (torch's ``allreduce_hook``), counted.
- ``fp16``: torch's ``fp16_compress_hook``: cast, divide by the world size, all-reduce, cast back.
- ``bf16``: torch's ``bf16_compress_hook``, called from our own hook. DDP refuses to *register* a hook named
  ``bf16_compress_hook`` unless torch was built with CUDA and NCCL >= 2.10 (a name check in
  ``DistributedDataParallel._check_comm_hook``), but gloo itself all-reduces CPU bf16 tensors
  (``c10::BFloat16`` in ProcessGroupGloo's type switch, summed through float and rounded to bf16 after
  each addition, as NCCL does), so on gloo the same cast/all-reduce/cast-back is correct and halves the bytes.
- ``powersgd``: our own PowerSGD (Vogels et al. 2019), error feedback and warm start; see ``_powersgd_hook``.

Why not torch's ``powerSGD_hook`` on gloo (2-rank trials, torch 2.13 CPU and 2.11 CUDA builds): it launches
its P and Q all-reduces from ``Future.then`` callbacks. On gloo those run on the process group's worker
threads when the previous collective ends, while DDP launches the next buckets' hooks from the autograd
thread; gloo pairs collectives across ranks by the order they are enqueued (a tag taken per call), so once
a model has more than one bucket that order can differ between ranks. Seen: aborts ("Received data size
doesn't match expected size" when one bucket's P meets another's), receive timeouts (a hang without a
collective timeout), a segfault. With one bucket the order is fixed and it ran. On a CUDA build it also
fails at its first compressed step on CPU tensors: ``torch.cuda.synchronize(device)`` with the CPU device.
(NCCL futures complete at enqueue, so there the callbacks run in order.) ``batched_powerSGD_hook`` fails
on any backend: it hands a 2-D Q to ``_orthogonalize``, which asserts a 3-D batch since the batched
rewrite of ``powerSGD_hook``. Our hook launches every collective from the hook itself, in bucket order: it
waits for P's all-reduce (on NCCL that wait only orders streams) and only the decompression, which
launches none, runs in a callback. The collectives' order is then a function of the bucket layout alone,
which DDP keeps identical on every rank.

Counting: ``CommCounter`` adds, per step, the bytes of every tensor this rank hands to an all-reduce
(``comm_bytes``) and the bytes a plain all-reduce of the same buckets would carry, i.e. the bucket sizes
(``comm_bytes_uncompressed``). Both are payload sizes; a ring all-reduce sends about 2(N-1)/N times that
per rank, the same factor for both, so their ratio is the saving on the wire.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and rejects them as strings.
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

KINDS = ("none", "fp16", "bf16", "powersgd")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CommCounter:
    """Bytes this rank all-reduces, with and without compression, since the last ``pop``.

    Only the hook's own thread writes it (collectives are launched there, never from callbacks).
    """

    bytes: int = 0
    bytes_uncompressed: int = 0
    collectives: int = 0
    buckets: int = 0

    def bucket(self, buffer: torch.Tensor) -> None:
        self.buckets += 1
        self.bytes_uncompressed += buffer.numel() * buffer.element_size()

    def all_reduce(self, numel: int, dtype: torch.dtype) -> None:
        self.collectives += 1
        self.bytes += numel * dtype.itemsize

    def pop(self) -> dict[str, int]:
        """The counts since the last call (one optimizer step when called once a step), then zero them."""
        out = {
            "comm_bytes": self.bytes,
            "comm_bytes_uncompressed": self.bytes_uncompressed,
            "comm_collectives": self.collectives,
            "comm_buckets": self.buckets,
        }
        self.bytes = self.bytes_uncompressed = self.collectives = self.buckets = 0
        return out


@dataclass
class _TensorMemory:
    """PowerSGD memory of one compressed parameter: the local error and the shared warm-start Q."""

    error: torch.Tensor  # (n, m) float32, this rank's residual
    q: torch.Tensor  # (m, r) float32, identical on every rank


@dataclass
class CompressionState:
    """Hook state: the process group, the byte counter and, for PowerSGD, its options and memory."""

    kind: str
    process_group: dist.ProcessGroup | None = None
    counter: CommCounter = field(default_factory=CommCounter)
    rank: int = 4
    min_compression_rate: float = 2.0
    start_iter: int = 0
    seed: int = 0
    eps: float = 1e-8
    iter: int = 0
    memory: dict[int, _TensorMemory] = field(default_factory=dict)  # by id(parameter)
    generator: torch.Generator | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def world_size(self) -> int:
        return dist.get_world_size(self.group)


def make_hook(
    kind: str,
    process_group: dist.ProcessGroup | None = None,
    rank: int = 4,
    *,
    min_compression_rate: float = 2.0,
    start_iter: int = 0,
    seed: int = 0,
) -> tuple[Hook, CompressionState]:
    """A DDP communication hook and its state for ``kind`` (one of ``KINDS``).

    ``rank`` is PowerSGD's approximation rank; a matrix (a parameter of 2 or more dimensions, viewed as
    shape[0] x the rest) is compressed only when ``(n + m) * rank * min_compression_rate < n * m``; others
    (1-D, 0-D, small matrices) are all-reduced uncompressed in one flat buffer per bucket. The first
    ``start_iter`` steps all-reduce plainly. ``seed`` must be the same on every rank (it draws the initial Q).
    """
    if kind not in KINDS:
        raise ValueError(f"distributed.gradient_compression: {kind!r} is not one of {', '.join(KINDS)}")
    if rank < 1:
        raise ValueError(f"distributed.powersgd_rank: must be >= 1, got {rank}")
    state = CompressionState(
        kind=kind,
        process_group=process_group,
        rank=rank,
        min_compression_rate=min_compression_rate,
        start_iter=start_iter,
        seed=seed,
    )
    hooks: dict[str, Hook] = {
        "none": _allreduce_hook,
        "fp16": _fp16_hook,
        "bf16": _bf16_hook,
        "powersgd": _powersgd_hook,
    }
    return hooks[kind], state


def _allreduce_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.counter.bucket(buffer)
    state.counter.all_reduce(buffer.numel(), buffer.dtype)
    return default_hooks.allreduce_hook(state.group, bucket)


def _fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.counter.bucket(buffer)
    state.counter.all_reduce(buffer.numel(), torch.float16)
    return default_hooks.fp16_compress_hook(state.group, bucket)


def _bf16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.counter.bucket(buffer)
    state.counter.all_reduce(buffer.numel(), torch.bfloat16)
    return default_hooks.bf16_compress_hook(state.group, bucket)


def _orthogonalize(matrix: torch.Tensor, eps: float) -> None:
    """Gram-Schmidt on the columns of ``matrix`` in place; ``eps`` keeps an all-zero column at zero."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col) + eps)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col * (col.T @ rest))


def _plan(state: CompressionState, grads: list[torch.Tensor]) -> list[tuple[int, int, int] | None]:
    """Per gradient: (n, m, r) to compress it as an n x m matrix at rank r, or None to send it as is."""
    plan: list[tuple[int, int, int] | None] = []
    for g in grads:
        if g.dim() < 2:
            plan.append(None)
            continue
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(state.rank, n, m)
        plan.append((n, m, r) if (n + m) * r * state.min_compression_rate < n * m else None)
    return plan


def _memory(
    state: CompressionState, param: torch.Tensor, n: int, m: int, r: int, device: torch.device
) -> _TensorMemory:
    mem = state.memory.get(id(param))
    if mem is None or mem.error.shape != (n, m) or mem.q.shape != (m, r):
        if state.generator is None:
            state.generator = torch.Generator().manual_seed(state.seed)
        # Buckets reach the hook in the same order with the same parameters on every rank, so every
        # rank draws the same Q for the same parameter.
        q = torch.randn(m, r, generator=state.generator, dtype=torch.float32).to(device)
        mem = _TensorMemory(error=torch.zeros(n, m, dtype=torch.float32, device=device), q=q)
        state.memory[id(param)] = mem
    return mem


def _powersgd_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD with error feedback: two all-reduces per bucket, both launched here, in bucket order.

    1. For each compressed gradient G (n x m): M = G + error, P = M Q (n x r) with Q warm-started from the
       last step (seeded random the first time). The uncompressed gradients and all P go in one flat buffer,
       all-reduced and divided by the world size; we wait for it.
    2. Orthonormalize P (identical on every rank), Q = M^T P (m x r) in a second flat buffer, all-reduced.
    3. In the callback (no collective there): Q /= N, G <- P Q^T (the same on every rank), error = M - P Q^T,
       keep Q for the next step.
    """
    buffer = bucket.buffer()
    counter = state.counter
    counter.bucket(buffer)
    warming_up = state.iter < state.start_iter
    if bucket.is_last():
        state.iter += 1
    grads = bucket.gradients()
    plan = _plan(state, grads)
    if warming_up or all(p is None for p in plan):
        counter.all_reduce(buffer.numel(), buffer.dtype)
        return default_hooks.allreduce_hook(state.group, bucket)

    group, world = state.group, state.world_size()
    device = buffer.device
    params = bucket.parameters()
    plain = [g for g, p in zip(grads, plan, strict=True) if p is None]
    compressed = [(g, param, p) for g, param, p in zip(grads, params, plan, strict=True) if p is not None]
    n_plain = sum(g.numel() for g in plain)
    n_p = sum(n * r for _, _, (n, _, r) in compressed)
    n_q = sum(m * r for _, _, (_, m, r) in compressed)

    flat_p = torch.empty(n_plain + n_p, dtype=torch.float32, device=device)
    if plain:
        torch.cat([g.reshape(-1).float() for g in plain], out=flat_p[:n_plain])
    flat_q = torch.empty(n_q, dtype=torch.float32, device=device)
    ms, ps, qs, mems = [], [], [], []
    p_off, q_off = n_plain, 0
    for g, param, (n, m, r) in compressed:
        mem = _memory(state, param, n, m, r, device)
        mat = g.reshape(n, m).to(torch.float32, copy=True).add_(mem.error)
        p = flat_p[p_off : p_off + n * r].view(n, r)
        torch.matmul(mat, mem.q, out=p)
        ms.append(mat)
        ps.append(p)
        qs.append(flat_q[q_off : q_off + m * r].view(m, r))
        mems.append(mem)
        p_off += n * r
        q_off += m * r

    counter.all_reduce(flat_p.numel(), flat_p.dtype)
    dist.all_reduce(flat_p, group=group, async_op=True).get_future().wait()
    flat_p.div_(world)
    offset = 0
    for g in plain:
        g.copy_(flat_p[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    for mat, p, q in zip(ms, ps, qs, strict=True):
        _orthogonalize(p, state.eps)
        torch.matmul(mat.T, p, out=q)

    counter.all_reduce(flat_q.numel(), flat_q.dtype)
    fut = dist.all_reduce(flat_q, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.wait()
        flat_q.div_(world)
        for (g, _, _), mat, p, q, mem in zip(compressed, ms, ps, qs, mems, strict=True):
            approx = p @ q.T
            torch.sub(mat, approx, out=mem.error)
            mem.q.copy_(q)
            g.copy_(approx.view_as(g))
        return buffer

    return fut.then(decompress)
