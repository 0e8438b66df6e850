"""Post-training weight quantization: torchao for nn.Linear layers, weight_only.py for the rest, in place.

    from gpuforge.weights.quantize import quantize_model, save_quantized, load_quantized, tensor_bytes

    result = quantize_model(model, "int8", skip=["classifier"])   # result.quantized, result.skipped
    save_quantized(model, path)
    rebuilt = build_the_float_model_again()
    load_quantized(rebuilt, "int8", path, skip=["classifier"])    # same outputs as `model`

Kinds, one table (`KINDS`), each a torchao 0.18 config per device type:

    int8           weight-only int8, one scale per output row
                   Int8WeightOnlyConfig
    int4           weight-only 4-bit in groups of 32 along in_features: two weights a byte, a bfloat16
                   scale and zero point a group, chosen by HQQ; tinygemm kernels computing in bfloat16
                   CPU: PrototypeInt4WeightOnlyConfig, CUDA: Int4WeightOnlyConfig(tile_packed_to_4d)
    int8-dynamic   int8 weights (per row) and int8 activations quantized per token at run time
                   Int8DynamicActivationInt8WeightConfig

A layer the kernel cannot take (in_features not a multiple of the group size, a weight tied to another
module, a Linear inside nn.MultiheadAttention, a weight already quantized) is skipped and listed with the
reason; it never makes quantization fail. Embeddings and Conv2d layers get the same kind's weight-only
form from weight_only.py (int8, or int4 for int4; int8-dynamic stores them int8), since they hold much of
a small model's bytes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from gpuforge.errors import GpuforgeError
from gpuforge.weights.weight_only import QuantizedLinear, quantize_other_layers, replace_layer

QUANT_KINDS = ("int8", "int4", "int8-dynamic")

MIN_SHARE = 0.01  # layers with a smaller share of the weights stay in float (_small_layers)
INT4_GROUP_SIZE = 32  # 4-bit weights share one scale and zero point per group of 32 input features
_FILE_FORMAT = "gpuforge.quantized/1"


@dataclass
class QuantResult:
    kind: str
    quantized: list[str] = field(default_factory=list)  # names of the nn.Linear modules quantized
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was left in float


@dataclass(frozen=True)
class _Kind:
    """How one kind quantizes a Linear on one device type: the torchao config, plus the shapes it takes."""

    # (device, only_structure) -> torchao AOBaseConfig; only_structure: the values will be overwritten by
    # load_quantized, so a costly search for good scales can be left out (same tensors, same layout)
    config: Callable[[torch.device, bool], object]
    shape_problem: Callable[[nn.Linear], str | None] = lambda linear: None
    prepare: Callable[[nn.Linear], None] = lambda linear: None  # runs just before quantize_


def _int8_config(device: torch.device, only_structure: bool):
    from torchao.quantization import Int8WeightOnlyConfig, PerRow

    # set_inductor_config=False: torchao would otherwise change torch._inductor's global settings for the
    # whole process, which is not ours to do from a quantization call.
    return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)


def _int8_dynamic_config(device: torch.device, only_structure: bool):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, PerRow
    from torchao.utils import should_reduce_range

    # reduce_range only on a CPU without VNNI, where the full int8 range can overflow the u8s8 products.
    return Int8DynamicActivationInt8WeightConfig(
        granularity=PerRow(), set_inductor_config=False, reduce_range=should_reduce_range(device)
    )


def _int4_config(device: torch.device, only_structure: bool):
    # HQQ picks each group's scale and zero point by a short optimization instead of min/max: on MiniLM the
    # mean-pooled embeddings keep cosine 0.956 (worst of 32 sentences) against 0.933, for 0.8 s more.
    algorithm = "tinygemm" if only_structure else "hqq"
    if device.type == "cpu":
        # torchao 0.18's Int4WeightOnlyConfig has no CPU packing (its default "plain" needs mslk CUDA
        # kernels); the CPU tinygemm layout (aten._weight_int4pack_mm_for_cpu) lives in the prototype config.
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(
            group_size=INT4_GROUP_SIZE, int4_choose_qparams_algorithm=algorithm, set_inductor_config=False
        )
    from torchao.quantization import Int4WeightOnlyConfig

    # tinygemm on CUDA (compute capability >= 8.0); "plain", the default, needs the mslk package. This
    # layout pads in_features to a multiple of 1024, which costs memory on narrow layers (384 -> 1024).
    return Int4WeightOnlyConfig(
        group_size=INT4_GROUP_SIZE,
        int4_packing_format="tile_packed_to_4d",
        int4_choose_qparams_algorithm=algorithm,
        set_inductor_config=False,
    )


def _int4_shape_problem(linear: nn.Linear) -> str | None:
    if linear.in_features % INT4_GROUP_SIZE:
        return f"in_features {linear.in_features} not a multiple of the group size {INT4_GROUP_SIZE}"
    if linear.weight.device.type == "cpu" and linear.out_features % 16:
        # aten._convert_weight_to_int4pack_for_cpu packs 16 output rows at a time (CUDA's packing pads)
        return f"out_features {linear.out_features} not a multiple of 16 (the CPU 4-bit kernel's tile)"
    return None


def _int4_prepare(linear: nn.Linear) -> None:
    # Both tinygemm kernels run in bfloat16. CUDA's takes bfloat16 weights only and casts activations and
    # output itself. CPU's computes in the activations' dtype, and in float32 it is some 30x slower than
    # the float layer at 1024 rows (measured, torchao 0.18 / torch 2.13), while in bfloat16 it matches it;
    # so on CPU the scales are made bfloat16 too and two hooks cast the layer's input to bfloat16 and its
    # output back to the layer's float dtype: the model around it sees what it saw before.
    dtype = linear.weight.dtype
    if dtype == torch.bfloat16:
        return
    linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
    if linear.weight.device.type == "cpu":
        linear.register_forward_pre_hook(_to_bfloat16)
        linear.register_forward_hook(partial(_output_to, dtype))


def _to_bfloat16(module: nn.Module, args: tuple) -> tuple:
    return (args[0].to(torch.bfloat16), *args[1:])


def _output_to(dtype: torch.dtype, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(dtype)


KINDS: dict[str, _Kind] = {
    "int8": _Kind(config=_int8_config),
    "int4": _Kind(config=_int4_config, shape_problem=_int4_shape_problem, prepare=_int4_prepare),
    "int8-dynamic": _Kind(config=_int8_dynamic_config),
}
assert tuple(KINDS) == QUANT_KINDS


def _import_torchao_quietly() -> None:
    """torchao logs a warning for each optional CUDA extension missing on a CPU build, and torch a
    deprecation line per enum it registers: noise on every `gpuforge compress`, so hush them once."""
    if sys.modules.get("torchao") is not None:  # imported already (None: marked unimportable)
        return
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.quantization  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _kind(kind: str) -> _Kind:
    if kind not in KINDS:
        raise GpuforgeError(f"unknown quantization kind {kind!r}: choose one of {', '.join(QUANT_KINDS)}")
    try:
        _import_torchao_quietly()
    except ImportError as err:
        raise GpuforgeError(
            f"quantization kind {kind!r} needs torchao, which is not installed: pip install torchao==0.18.0"
        ) from err
    return KINDS[kind]


def _skip_reasons(module: nn.Module, spec: _Kind, skip: Iterable[str]) -> dict[str, str | None]:
    """Every nn.Linear of `module` by name -> why it must stay in float, or None when it can be quantized."""
    skip = list(skip)
    modules = dict(module.named_modules())
    unknown = [name for name in skip if name not in modules]
    if unknown:
        raise GpuforgeError(f"quantize skip: no module named {', '.join(map(repr, unknown))} in the model")
    owners: dict[int, list[str]] = {}  # which modules hold each parameter: a tied weight has several
    for name, mod in modules.items():
        for param in mod._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    attention = {
        f"{name}.out_proj" for name, mod in modules.items() if isinstance(mod, nn.MultiheadAttention)
    }

    reasons: dict[str, str | None] = {}
    for name, mod in modules.items():
        if not isinstance(mod, nn.Linear):
            continue
        weight = mod.weight
        if any(name == s or name.startswith(f"{s}.") for s in skip):
            reasons[name] = "skipped on request"
        elif is_traceable_wrapper_subclass(weight):
            reasons[name] = f"weight is already a {type(weight).__name__}"
        elif not weight.is_floating_point():
            reasons[name] = f"weight dtype {weight.dtype} is not floating point"
        elif weight.device.type not in ("cpu", "cuda"):
            reasons[name] = f"weight on {weight.device.type}: torchao kernels run on cpu and cuda only"
        elif name in attention or isinstance(mod, nn.modules.linear.NonDynamicallyQuantizableLinear):
            reasons[name] = "inside nn.MultiheadAttention, which reads the float weight directly"
        elif len(tied := [o for o in owners[id(weight)] if o != name]) > 0:
            reasons[name] = f"weight tied to {tied[0]}"
        else:
            reasons[name] = spec.shape_problem(mod)
    return reasons


def quantize_model(module: nn.Module, kind: str, skip: Iterable[str] = ()) -> QuantResult:
    """Quantize every nn.Linear of `module` in place (CPU or CUDA, wherever it lives), except names in `skip`
    (e.g. a tiny classification head) and layers whose shape the kernel cannot take: those are skipped and
    listed with the reason, never a crash. Raise gpuforge.errors.GpuforgeError (or a subclass that fits,
    see src/gpuforge/errors.py) naming the kind for an unknown kind, or when torchao is missing."""
    return _quantize(module, kind, skip, only_structure=False)


def _quantize(module: nn.Module, kind: str, skip: Iterable[str], only_structure: bool) -> QuantResult:
    spec = _kind(kind)
    from torchao.quantization import quantize_

    result = QuantResult(kind)
    modules = dict(module.named_modules())
    small = _small_layers(module)
    bits = 4 if kind == "int4" else 8
    for name, reason in _skip_reasons(module, spec, skip).items():
        linear = modules[name]
        if name in small and reason is None:
            reason = small[name]
        if reason is not None and reason == spec.shape_problem(linear):
            # a shape torchao's kernel cannot take (a 10-class head in int4): our weight-only form
            replace_layer(module, name, QuantizedLinear(linear, bits))
            result.quantized.append(name)
            continue
        if reason is not None:
            result.skipped[name] = reason
            continue
        spec.prepare(linear)
        # On the Linear itself: torchao's handler swaps its weight for a tensor subclass, in place.
        quantize_(linear, spec.config(linear.weight.device, only_structure))
        result.quantized.append(name)
    # embeddings and convolutions: weight-only, our own modules (torchao's configs take Linear only)
    others, why = quantize_other_layers(module, bits, list(skip), small)
    result.quantized += others
    result.skipped.update(why)
    return result


def _small_layers(module: nn.Module) -> dict[str, str]:
    """Layers of a kind and shape that together hold under MIN_SHARE of the model's weights stay in float:
    quantizing them saves almost nothing, and they are often the sensitive ones (position and token-type
    tables, a first convolution, a classification head). Counted per kind and shape, so the 24 attention
    projections of a 6-layer transformer count as the 16% they hold together, not 0.65% each. Decided
    from shapes alone, so loading decides the same."""
    families: dict[tuple, list[str]] = {}
    sizes: dict[tuple, int] = {}
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)) and isinstance(m.weight, torch.Tensor):
            key = (type(m), tuple(m.weight.shape))
            families.setdefault(key, []).append(name)
            sizes[key] = sizes.get(key, 0) + m.weight.numel()
    total = sum(sizes.values())
    why = "its kind and shape hold {:.2%} of the weights (< {:.0%}): kept in float"
    return {
        name: why.format(sizes[key] / total, MIN_SHARE)
        for key, names in families.items()
        if sizes[key] < MIN_SHARE * total
        for name in names
    }


def _nbytes(tensor: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(tensor):  # torchao: the packed data and scales it holds inside
        inner, _ = tensor.__tensor_flatten__()
        return sum(_nbytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def tensor_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters and buffers hold in memory, counting torchao tensor subclasses by
    their inner packed data and scales (not by the float shape they pretend to have)."""
    tensors = [*module.parameters(), *module.buffers()]  # each shared tensor once
    return sum(_nbytes(t) for t in tensors)


def save_quantized(module: nn.Module, path: Path) -> None:
    """Write the quantized module's state to `path` (one file)."""
    # torch.save, not safetensors: torchao 0.18's safetensors helpers (torchao.prototype.safetensors) know
    # Int8Tensor but not Int4OpaqueTensor, the CPU 4-bit layout, so one format for all kinds is a pickle
    # of the state dict. Loading it runs no code beyond torch's weights-only unpickler (see load_quantized).
    torch.save({"format": _FILE_FORMAT, "state_dict": module.state_dict()}, Path(path))


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise GpuforgeError(f"quantized weights not found: {path}")
    # weights_only=True: torchao registers its tensor subclasses and their attribute types with
    # torch.serialization.add_safe_globals, so nothing but tensors and plain values is unpickled.
    import torchao.prototype.quantization.int4  # noqa: F401  (registers Int4OpaqueTensor as a safe global)

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt or foreign file: the message says which
        raise GpuforgeError(f"cannot read quantized weights from {path}: {err}") from err
    if not isinstance(saved, dict) or saved.get("format") != _FILE_FORMAT:
        raise GpuforgeError(f"{path} is not a gpuforge quantized-weights file (save_quantized writes them)")
    return saved["state_dict"]


def load_quantized(module: nn.Module, kind: str, path: Path, skip: Iterable[str] = ()) -> QuantResult:
    """`module` is the float model rebuilt the same way as before quantizing: quantize its structure the
    same way, then load the saved weights into it, so the outputs equal those of the module that was saved."""
    _kind(kind)  # an unknown kind or a missing torchao is told before the file is read
    state = _load_file(path)
    result = _quantize(module, kind, skip, only_structure=True)
    own = module.state_dict()
    missing = sorted(own.keys() - state.keys())
    extra = sorted(state.keys() - own.keys())
    if missing or extra:
        raise GpuforgeError(
            f"{path} does not fit this model: missing {missing[:5]}, unexpected {extra[:5]} "
            f"(rebuild the model exactly as it was before quantize_model)"
        )
    for name, tensor in state.items():
        if type(tensor) is not type(own[name]) or tensor.shape != own[name].shape:
            raise GpuforgeError(
                f"{path}: {name} was saved as {type(tensor).__name__}{list(tensor.shape)} but quantizing "
                f"with kind {kind!r} makes it {type(own[name]).__name__}{list(own[name].shape)}: "
                "load with the kind, skip list and device the model was saved with"
            )
    # Copy into the tensors quantize_model just made (torchao's copy_ copies the packed data and scales);
    # its metadata check wants both on one device, so move each saved tensor to its module's first.
    state = {name: t.to(own[name].device) for name, t in state.items()}
    try:
        module.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as err:  # e.g. saved from a bfloat16 model, loaded into a float32 one
        raise GpuforgeError(f"{path} does not fit this model as quantized with kind {kind!r}: {err}") from err
    return result
