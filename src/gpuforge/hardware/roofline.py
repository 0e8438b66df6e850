"""A step's time on a device it has never run on: every operation of one real step, traced, then timed by
a roofline (its FLOPs at the device's matmul speed for its size, or its bytes over the memory bandwidth,
whichever is longer) plus the fixed cost of one operation.

    trace = OpTrace.of(lambda: one_training_step())     # on this machine, at its micro-batch
    seconds = trace.seconds(roof, batch_scale=4.0)       # on a device described by `roof`

Why per operation: a small model's step is not "FLOPs / peak". Its matmuls are small (a fraction of the
peak), its elementwise ops move bytes and do little arithmetic, and each op pays a fixed dispatch or launch
cost. Summing the three per op is what makes a CPU's estimate and a GPU's come out of the same trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

aten = torch.ops.aten

# what a view or a query costs is its dispatch only: no bytes move
_NO_DATA = {
    aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.as_strided, aten.alias, aten.detach,
    aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.narrow, aten.lift_fresh,
}  # fmt: skip

CONVERSION = 0  # the width key of a conversion's bandwidth (fp32 <-> bf16)

# ops whose arithmetic, not their bytes, bounds them on a CPU: random numbers (dropout's masks) and
# transcendental functions (exp, erf, tanh); a GPU's special units make both memory-bound there
_RNG = (
    "randint",
    "rand",
    "randn",
    "bernoulli",
    "bernoulli_",
    "uniform_",
    "normal_",
    "native_dropout",
    "randperm",
)
_TRANSCENDENTAL = (
    "gelu", "gelu_backward", "_softmax", "_softmax_backward_data", "_log_softmax",
    "_log_softmax_backward_data", "tanh", "tanh_backward", "exp", "erf", "sigmoid", "sigmoid_backward",
    "silu", "silu_backward", "log",
)  # fmt: skip
_SPECIAL = {**dict.fromkeys(_RNG, "rng"), **dict.fromkeys(_TRANSCENDENTAL, "transcendental")}

_CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": 1.0,  # forward: 4 b h s s d
    "_scaled_dot_product_flash_attention_for_cpu_backward": 2.5,  # two to three times the forward
}


@dataclass
class Op:
    name: str
    flops: float  # the arithmetic, 0 for an op with no formula (elementwise: bytes decide)
    batch_bytes: int  # bytes read and written that grow with the batch (activations)
    fixed_bytes: int  # bytes that do not: parameters, their gradients, optimizer state
    size: float  # a matmul's edge (cube root of m n k), for the efficiency of its shape; 0 otherwise
    weight_only: bool  # an op of the optimizer's update: it does not grow with the batch
    element_bytes: int = 4  # its narrowest type's (1: bool, ints): bf16 moves at its own speed on a CPU
    # CONVERSION (0): between float widths, as autocast's casts: a CPU converts each element, slowly
    special: str = ""  # "rng" or "transcendental": an op a CPU computes slower than it moves the bytes
    elements: int = 0  # of its output, for a special op's rate


@dataclass(frozen=True)
class Roof:
    """What a device does, as the roofline needs it; `efficiency(size)` is a matmul's fraction of peak."""

    name: str
    peak_tflops: float  # matmul, at the job's precision
    efficiency: Callable[[float], float]  # a matmul's fraction of that peak, by its edge
    bandwidth: Callable[[float, int], float]  # GB/s an op reaches, by the bytes it moves and their width
    op_overhead_s: float
    special_gelems: dict[str, float] = field(default_factory=dict)  # elements/s (1e9) of special ops
    # what a real step reaches of this ideal (measured on our reference step; a typical figure where we
    # could not measure): the estimate is the roofline's time over it
    step_efficiency: float = 1.0


@dataclass
class OpTrace:
    ops: list[Op] = field(default_factory=list)

    @classmethod
    def of(cls, step: Callable[[], None], parameters=(), batch_free: bool = False) -> OpTrace:
        """Run `step` once and record each of its operations. Bytes of `parameters` (and of their gradients)
        do not grow with the batch; with `batch_free` nothing in the step does (an optimizer's update)."""
        trace = cls()
        fixed = {_storage(t) for t in parameters}
        fixed |= {_storage(p.grad) for p in parameters if p.grad is not None}
        with _Recorder(trace, fixed, batch_free):
            step()
        return trace

    def extend(self, other: OpTrace) -> OpTrace:
        self.ops.extend(other.ops)
        return self

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def seconds(self, roof: Roof, batch_scale: float = 1.0) -> float:
        """The traced step on `roof`'s device, with a batch `batch_scale` times the traced one: the
        roofline's ideal over the fraction of it a real step reaches there."""
        return self.ideal_seconds(roof, batch_scale) / roof.step_efficiency

    def ideal_seconds(self, roof: Roof, batch_scale: float = 1.0) -> float:
        return sum(self.parts(roof, batch_scale).values())

    def parts(self, roof: Roof, batch_scale: float = 1.0) -> dict[str, float]:
        """The roofline's time in three parts: ops bound by compute, ops bound by memory, and the fixed
        cost of each op."""
        out = {"compute_s": 0.0, "memory_s": 0.0, "overhead_s": roof.op_overhead_s * len(self.ops)}
        for op in self.ops:
            scale = 1.0 if op.weight_only else batch_scale
            moved = op.batch_bytes * scale + op.fixed_bytes
            memory = moved / (roof.bandwidth(moved, op.element_bytes) * 1e9)
            compute = 0.0
            if op.size:
                efficiency = roof.efficiency(op.size * scale ** (1 / 3))
                compute = op.flops * scale / (roof.peak_tflops * 1e12 * efficiency)
            elif op.special in roof.special_gelems:
                compute = op.elements * scale / (roof.special_gelems[op.special] * 1e9)
            out["compute_s" if compute > memory else "memory_s"] += max(compute, memory)
        return out


def matmul_efficiency(curve: dict[int, float], peak: float) -> Callable[[float], float]:
    """A matmul's fraction of `peak` by its size, interpolated on a measured curve (log of the size)."""
    points = sorted((math.log(n), min(1.0, tf / peak)) for n, tf in curve.items() if tf > 0)

    def efficiency(size: float) -> float:
        x = math.log(max(size, 1.0))
        if x <= points[0][0]:
            return max(points[0][1] * (size / math.exp(points[0][0])) ** 2, 1e-3)  # tiny: falls as its area
        return _interpolate(points, x)

    return efficiency


def bandwidth_by_size(curves: dict[int, dict[int, float]]) -> Callable[[float, int], float]:
    """GB/s by bytes moved, interpolated on measured curves, one per element width (4: fp32, 2: bf16)."""
    tables = {
        width: sorted((math.log(b), gbs) for b, gbs in curve.items()) for width, curve in curves.items()
    }

    def bandwidth(moved: float, element_bytes: int) -> float:
        floats = [w for w in tables if w != CONVERSION]
        if element_bytes in tables:
            width = element_bytes
        else:  # one we did not measure: below the narrowest float (bool, int8) as it, else as the widest
            width = min(floats) if element_bytes < min(floats) else max(floats)
        return _interpolate(tables[width], math.log(max(moved, 1.0)))

    return bandwidth


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at x on a line through sorted (x, y) points; the end points' y beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def saturating_efficiency(best: float, half_size: float) -> Callable[[float], float]:
    """For a device we could not measure: `best` of peak for large matmuls, half of it at `half_size`
    (a GPU needs a matmul of about a thousand on each side to fill its cores)."""
    return lambda size: best * size**2 / (size**2 + half_size**2)


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: OpTrace, fixed: set[int], batch_free: bool):
        super().__init__()
        self.trace, self.fixed, self.batch_free = trace, fixed, batch_free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _NO_DATA or not (_has_tensor(out) or packet.__name__.endswith("_")):
            return out  # a view, a query; an in-place op (the optimizer's) returns nothing but moves bytes
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif packet.__name__ in _CPU_ATTENTION:
            q, k, v = args[0:3] if packet.__name__.endswith("cpu") else args[1:4]
            flops = _CPU_ATTENTION[packet.__name__] * sdpa_flop_count(q.shape, k.shape, v.shape)
        batch_bytes = fixed_bytes = 0
        widths = set()
        seen = set()
        for t in tree_flatten((args, kwargs, out))[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or _view(t) in seen:
                continue
            seen.add(_view(t))  # the same view twice is read once; two slices of one tensor are two reads
            if t.numel() > 1:
                widths.add(t.element_size() if t.is_floating_point() else 1)
            if self.batch_free or _storage(t) in self.fixed:
                fixed_bytes += _bytes(t)
            else:
                batch_bytes += _bytes(t)
        floats = {w for w in widths if w > 1}
        element_bytes = CONVERSION if len(floats) > 1 else min(widths, default=4)
        if packet.__name__.endswith("_") and args:  # in place: what it reads, it writes back
            written = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            for t in written:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    if self.batch_free or _storage(t) in self.fixed:
                        fixed_bytes += _bytes(t)
                    else:
                        batch_bytes += _bytes(t)
        size = (flops / 2) ** (1 / 3) if flops else 0.0  # a matmul's (or convolution's) edge
        special = _SPECIAL.get(packet.__name__, "")
        elements = max((t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), default=0)
        self.trace.ops.append(
            Op(
                packet.__name__,
                flops,
                batch_bytes,
                fixed_bytes,
                size,
                self.batch_free,
                element_bytes,
                special,
                elements,
            )
        )
        return out


def _bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements span: a broadcast (a stride of 0) reads its storage, not its shape."""
    if 0 in t.stride() and t.numel() > 1:
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    return t.numel() * t.element_size()


def _view(t: torch.Tensor) -> tuple:
    return (_storage(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _has_tensor(out) -> bool:
    leaves, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) for t in leaves)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)
