"""A model directory as an ONNX export, for runtimes other than torch (ONNX Runtime and its execution
providers, OpenVINO, NPUs) and for ONNX Runtime's own CPU speed:

    gpuforge export runs/x/model --format onnx --out exports/x [--quantize int8] [--opset 18]

The export directory holds model.onnx (one file: weights inside, up to 2 GB), the tokenizer and
gpuforge.json (format onnx): `gpuforge serve DIR` and load_artifact take it as they take the model it came
from. Adapters are merged into their base first; a variant quantized by torch is refused (its int8 layers
have no ONNX form): export the float model and pass --quantize int8, onnxruntime's dynamic quantization.

torch's dynamo exporter is tried first; where it cannot trace the model, the TorchScript exporter. The
batch (and a text model's sequence) axes are dynamic. Parity with the torch model is measured on the
run's held-out split (parity.py) into export_report.json.

A transformers causal LM is exported with its key/value cache (past_key_I/past_value_I in, present_key_I/
present_value_I out, the cache's length dynamic too), so that the export generates as the model does, one
new token a pass: `gpuforge serve` runs it behind the completion routes. Where that graph cannot be made,
the logits alone are exported (a forward over whole sequences: scoring, not generation), and the log says
why.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from gpuforge.artifact import MANIFEST, Manifest, built_from, load_artifact, read_manifest, write_manifest
from gpuforge.artifact.manifest import OnnxCacheRecord, OnnxRecord
from gpuforge.artifact.onnx_module import ONNX_INSTALL
from gpuforge.errors import GpuforgeError
from gpuforge.runtime import tasks
from gpuforge.runtime.kv_cache import cache_argument, cache_layers, returned_cache

log = logging.getLogger("gpuforge.export")

GRAPH = "model.onnx"
REPORT = "export_report.json"
DEFAULT_OPSET = 18
MIN_OPSET, MAX_OPSET = 14, 21  # what torch's exporters write and onnxruntime 1.2x runs
ONE_FILE_LIMIT = 1.8e9  # bytes of weights past which the graph keeps them in model.onnx.data (protobuf: 2 GB)


class ExportError(GpuforgeError):
    """A model that cannot be exported, or an export that cannot be written where it was asked."""


def export_onnx(
    model_dir: str | Path, out: str | Path, quantize: str | None = None, opset: int = DEFAULT_OPSET
):
    """Write the ONNX export of `model_dir` into `out`; (the export's manifest, the torch module it was
    made from, its built model) for the parity measure."""
    model_dir, out = Path(model_dir), Path(out).resolve()  # a link's target: the folder that is replaced
    if quantize not in (None, "int8"):
        raise ExportError(f"--quantize: int8 or nothing, not {quantize!r}")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(
            f"--opset {opset}: torch writes and onnxruntime runs opsets {MIN_OPSET} to {MAX_OPSET}"
        )
    _check_modules()
    stored = read_manifest(model_dir)
    _check_exportable(model_dir, stored)
    _check_out(out, model_dir)
    module, tokenizer, manifest = load_artifact(model_dir, "cpu", dequantize_base=bool(stored.quantize_base))
    if manifest.is_adapter:  # the adapter folded into its base: one plain model to export
        from gpuforge.weights.merge import merge_adapter

        module = merge_adapter(module)
    module = module.float().eval()
    built = built_from(module, manifest)
    names, sample, dynamic = _inputs(built, manifest, tokenizer)
    cache, no_cache = _cache_layout(built, manifest.task, sample[0])
    big = sum(t.numel() * t.element_size() for t in module.state_dict().values()) > ONE_FILE_LIMIT
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside --out and swapped in whole: a failure leaves an earlier export as it was
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.export-") as work:
        staged, scratch = Path(work) / "export", Path(work) / "scratch"
        staged.mkdir()
        scratch.mkdir()
        graph = scratch / GRAPH
        if cache is not None:
            no_cache = _export_with_cache(built.module, cache, sample[0], graph, opset, big)
        if no_cache is None and cache is not None:
            exporter, names = "dynamo", _cache_inputs(cache)
        else:
            cache = None
            if getattr(getattr(module, "config", None), "use_cache", False):
                module.config.use_cache = False  # logits only: no key/value cache to trace through
            wrapper = _Logits(built, manifest.task, names)
            exporter = _export(wrapper, sample, names, dynamic, graph, opset, big, manifest.task)
        if quantize == "int8":
            graph = _quantize_int8(graph, scratch / "int8" / GRAPH, big)
        for f in graph.parent.iterdir():  # model.onnx, and model.onnx.data for a big one
            if f.is_file():
                shutil.move(str(f), staged / f.name)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staged))
        files = sorted(f.name for f in staged.iterdir())
        exported = _manifest(manifest, model_dir, opset, exporter, names, quantize, files, _positions(module))
        exported.onnx.cache, exported.onnx.no_cache = cache, no_cache
        write_manifest(staged, exported)
        _swap_in(staged, out, Path(work) / "earlier")
    log.info("exported %s to %s (%s exporter, opset %d%s)", model_dir, out / GRAPH, exporter, opset,
             ", int8" if quantize else "")  # fmt: skip
    return exported, module, built


def _check_modules() -> None:
    for name in ("onnx", "onnxruntime"):
        try:
            __import__(name)
        except ImportError:
            raise ExportError(f"--format onnx needs {name}: {ONNX_INSTALL}") from None


def _check_exportable(model_dir: Path, manifest: Manifest) -> None:
    if manifest.format == "onnx":
        raise ExportError(f"{model_dir}: an ONNX export already; export the model directory it came from")
    if manifest.quantization:
        origin = manifest.compression.from_ if manifest.compression else None
        raise ExportError(
            f"{model_dir}: a variant quantized by torch ({manifest.quantization}), whose layers have no ONNX "
            f"form: export the float model{f' ({origin})' if origin else ''} with --quantize int8 instead"
        )


def _check_out(out: Path, model_dir: Path) -> None:
    """`out` must be new, empty, or an earlier ONNX export holding only the files it wrote (replaced once
    the new one is made); never inside the model directory."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: a file, not a directory")
    if out.resolve() == model_dir.resolve() or model_dir.resolve() in out.resolve().parents:
        raise ExportError(f"--out {out}: inside the model directory it exports; choose another")
    # the export is made beside --out and moved in whole: its parent must take a new folder
    if out.exists() and os.path.ismount(out):
        raise ExportError(f"--out {out}: a mount point, which cannot be replaced; export into a folder in it")
    parent = next((p for p in out.parents if p.exists()), out.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {parent} is not writable")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        earlier = read_manifest(out)
    except GpuforgeError:
        earlier = None
    ours = {MANIFEST, REPORT, *(earlier.onnx.files if earlier is not None and earlier.onnx else [])}
    strays = [p.name for p in out.iterdir() if p.name not in ours]
    if earlier is None or earlier.format != "onnx" or strays:
        shown = ", ".join(sorted(strays)[:5]) or MANIFEST
        raise ExportError(
            f"--out {out}: holds something other than an ONNX export ({shown}); choose an empty directory"
        )


def _swap_in(staged: Path, out: Path, aside: Path) -> None:
    """`staged` becomes `out`; an earlier export there is moved aside (and goes with the temporary
    directory), never merged with the new one."""
    if out.exists():
        out.rename(aside)
    try:
        staged.rename(out)
    except OSError as err:
        if aside.exists():
            aside.rename(out)  # the earlier export back where it was
        raise ExportError(f"--out {out}: cannot put the export there ({err.strerror})") from None


def _positions(module: torch.nn.Module) -> int | None:
    """The longest sequence a transformers model takes (serve caps --max-length with it)."""
    return getattr(getattr(module, "config", None), "max_position_embeddings", None)


class _Logits(torch.nn.Module):
    """The model as the graph's inputs reach it, giving logits only (no loss, no cache)."""

    def __init__(self, built, task: str, names: list[str]):
        super().__init__()
        self.model, self.built, self.task, self.names = built.module, built, task, names

    def forward(self, main: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch = {self.names[0]: main}
        if attention_mask is not None:
            batch["attention_mask"] = attention_mask
        return tasks.forward(self.built, self.task, batch)


class _WithCache(torch.nn.Module):
    """A transformers causal LM as its cache graph runs it: ids, mask, positions and the cache as flat
    tensors in; logits and the cache grown by the new tokens out."""

    def __init__(self, model: torch.nn.Module, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(self.layers):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=True, **{cache_argument(self.model): cache},
        )  # fmt: skip
        return (out.logits, *[t for kv in cache_layers(returned_cache(out)) for t in kv])


def _cache_layout(built, task: str, ids: torch.Tensor) -> tuple[OnnxCacheRecord | None, str | None]:
    """The shape of a transformers causal LM's key/value cache, read from one pass of the model, or why
    its cache cannot go into the graph (logged: the logits alone are exported); (None, None) for a model
    that is not a causal LM."""
    if task != "causal-lm":
        return None, None
    record, why = _cache_record(built, ids)
    if why is not None:
        log.info("no key/value cache in the export (%s): its logits alone are exported", why)
    return record, why


def _cache_record(built, ids: torch.Tensor) -> tuple[OnnxCacheRecord | None, str | None]:
    if not built.is_transformers:
        return None, "not a transformers model, whose cache gpuforge knows"
    config = built.module.config
    kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention"}
    if getattr(config, "sliding_window", None) or kinds:
        # a sliding window's cache is cut and counted by the cache object itself, which the graph's flat
        # tensors do not carry from one pass to the next
        return None, f"layers of kind {', '.join(sorted(kinds)) or 'sliding_attention'}"
    try:
        with torch.inference_mode():
            out = built.module(input_ids=ids, use_cache=True)
        layers = cache_layers(returned_cache(out))
    except Exception as err:  # noqa: BLE001 (a model of its own kind: its logits alone are exported)
        return None, f"no cache read from one pass of the model: {_what_failed(err)}"
    shaped = all(k is not None and v is not None and k.dim() == 4 and k.shape == v.shape for k, v in layers)
    if not layers or not shaped:
        return None, "a cache whose layers are not each keys and values of one shape"
    eos = getattr(getattr(built.module, "generation_config", None), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    keys = layers[0][0]
    record = OnnxCacheRecord(
        layers=len(layers), heads=keys.shape[1], head_dim=keys.shape[3], eos_token_ids=eos,
        vocab_size=out.logits.shape[-1],
    )  # fmt: skip
    return record, None


def _cache_inputs(cache: OnnxCacheRecord) -> list[str]:
    past = [f"past_{kind}_{layer}" for layer in range(cache.layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past]


def _cache_sample(cache: OnnxCacheRecord, ids: torch.Tensor) -> tuple:
    """2 rows of 3 new tokens after 5 cached ones: sizes that differ from each other (torch.export takes
    equal sizes for one symbol) and from 0 and 1 (which it fixes)."""
    ids, held = ids[:2, :3], 5
    mask = torch.ones(2, held + 3, dtype=torch.long)
    positions = torch.arange(held, held + 3)[None].repeat(2, 1)
    past = [torch.randn(2, cache.heads, held, cache.head_dim) for _ in range(2 * cache.layers)]
    return (ids, mask, positions, *past)


def _export_with_cache(model, cache: OnnxCacheRecord, ids, graph: Path, opset: int, big: bool) -> str | None:
    """The cache graph of a causal LM (dynamo exporter): None once made and checked, else why not (logged).
    Checked: it runs at other sizes, with an empty cache (the first pass of each generation), and through
    its own cache over left-padded prompts of two lengths as the model does through its own."""
    wrapper = _WithCache(model, cache.layers)
    names, sample = _cache_inputs(cache), _cache_sample(cache, ids)
    outputs = ["logits", *[name.replace("past_", "present_") for name in names[3:]]]
    free = torch.export.Dim.DYNAMIC
    shapes = ({0: free, 1: free},) * 3 + (tuple({0: free, 2: free} for _ in names[3:]),)
    try:
        with _quiet():
            torch.onnx.export(
                wrapper, sample, str(graph), input_names=names, output_names=outputs, opset_version=opset,
                dynamo=True, dynamic_shapes=shapes, external_data=big, verbose=False,
            )  # fmt: skip
        _check_runs(graph, wrapper, sample)
        _check_empty_cache(graph, wrapper, sample)
        _check_decode(graph, model, cache, ids)
        return None
    except (OSError, MemoryError):
        raise  # the machine's trouble, not the model's: said as it is
    except Exception as err:  # torch raises many types here; the logits-only export follows
        why = _what_failed(err)
        log.info(
            "the model could not be exported with its key/value cache (%s): its logits alone are exported, "
            "which score sequences but cannot generate", why,
        )  # fmt: skip
        for leftover in graph.parent.glob(f"{GRAPH}*"):
            leftover.unlink()
        return why


def decode_gap(model, onnx_module, prompt: torch.Tensor, mask: torch.Tensor, steps: int) -> tuple[float, int]:
    """Generation through both caches from left-padded `prompt`: the prompt's pass, then `steps` greedy
    tokens (the model's pick fed to both). (Largest logit difference at any pass, passes where both picked
    the same token, summed over the rows.)"""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    worst, same = 0.0, 0
    with torch.inference_mode():
        expected = model(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
        got = onnx_module(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
        for step in range(steps + 1):
            last, theirs = expected.logits[:, -1].float(), got.logits[:, -1].float()
            worst = max(worst, float((last - theirs).abs().max()))
            picked = last.argmax(-1)
            same += int((theirs.argmax(-1) == picked).sum())
            if step == steps:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            step_in = {"input_ids": picked[:, None], "attention_mask": mask, "position_ids": positions}
            expected = model(**step_in, use_cache=True, **{cache_argument(model): returned_cache(expected)})
            got = onnx_module(**step_in, past_key_values=got.past_key_values, use_cache=True)
    return worst, same


def _check_decode(graph: Path, model, cache: OnnxCacheRecord, ids: torch.Tensor) -> None:
    """Prompts of 2 and 5 tokens, left-padded to one batch, then 3 greedy steps: the graph's logits
    through its own cache must be the model's through its own (to 1e-3)."""
    from gpuforge.artifact.onnx_module import OnnxModule

    row = ids[0].repeat(5)[:5]
    prompt, mask = torch.stack([row, row]), torch.ones(2, 5, dtype=torch.long)
    prompt[0, :3], mask[0, :3] = 0, 0
    onnx_module = OnnxModule(graph, _cache_inputs(cache), "cpu", cache=cache)
    gap, _ = decode_gap(model, onnx_module, prompt, mask, steps=3)
    if not gap <= 1e-3:
        raise ExportError(f"through its cache the graph's logits differ from the model's by {gap:.3g}")


def _check_empty_cache(graph: Path, wrapper, sample: tuple) -> None:
    """A generation's first pass has no cache yet: the graph must take one of length 0 and give torch's
    logits for the prompt."""
    import onnxruntime

    ids = sample[0]
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None].repeat(ids.shape[0], 1)
    past = [t[:, :, :0] for t in sample[3:]]
    session = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    given = (ids, mask, positions, *past)
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), given, strict=True)}
    got = session.run(None, feed)[0]
    with torch.inference_mode():
        expected = wrapper(*given)[0]
    if tuple(got.shape) != tuple(expected.shape) or not torch.allclose(
        torch.from_numpy(got), expected, atol=1e-3, rtol=1e-3
    ):
        raise ExportError("with an empty cache the graph's logits differ from torch's")


def _inputs(built, manifest: Manifest, tokenizer) -> tuple[list[str], tuple, dict[str, dict[int, str]]]:
    """The graph's input names, a sample batch to trace with (2 rows, longer than 1: a size of 1 would be
    fixed in the graph) and each input's dynamic axes."""
    if manifest.task == "image-classification":
        shape = manifest.sample_shape
        if not shape:
            raise ExportError("the manifest has no sample_shape: the image size to export with is unknown")
        return ["pixel_values"], (torch.rand(2, *shape),), {"pixel_values": {0: "batch"}}
    if tokenizer is None:
        raise ExportError("a text model without its tokenizer in the model directory")
    # one sentence twice: no padding, which a tokenizer may not have (GPT-2's)
    ids = tokenizer("an example sentence to trace the model with", return_tensors="pt")["input_ids"]
    ids = ids.repeat(2, 1)
    axes = {0: "batch", 1: "sequence"}
    takes_mask = built.is_transformers or tasks.accepts(built.module, "attention_mask")
    if not takes_mask:
        return ["input_ids"], (ids,), {"input_ids": axes}
    sample = (ids, torch.ones_like(ids))
    return ["input_ids", "attention_mask"], sample, {"input_ids": axes, "attention_mask": axes}


def _export(wrapper, sample, names, dynamic, graph: Path, opset: int, big: bool, task: str) -> str:
    """Export with torch's dynamo exporter, else its TorchScript one; the one that worked. Both failing is
    an ExportError with what each said (the operator it could not convert, where torch names it)."""
    shapes = {name: {axis: torch.export.Dim(label) for axis, label in axes.items()}
              for name, axes in dynamic.items()}  # fmt: skip
    dims = {
        "main": shapes[names[0]],
        **({"attention_mask": shapes["attention_mask"]} if len(names) > 1 else {}),
    }
    try:
        with _quiet():
            torch.onnx.export(
                wrapper, sample, str(graph), input_names=names, output_names=["logits"], opset_version=opset,
                dynamo=True, dynamic_shapes=dims, external_data=big, verbose=False,
            )  # fmt: skip
        _check_runs(graph, wrapper, sample)  # its conversion to an older opset can write nodes it lacks
        return "dynamo"
    except Exception as err:  # torch raises many types here; the fallback below says if it matters
        dynamo_error = _what_failed(err)
        log.info(
            "the dynamo exporter could not export the model (%s); trying the TorchScript one", dynamo_error
        )
    for leftover in graph.parent.glob(f"{GRAPH}*"):
        leftover.unlink()
    try:
        with _quiet():
            torch.onnx.export(
                wrapper, sample, str(graph), input_names=names, output_names=["logits"], opset_version=opset,
                dynamo=False, dynamic_axes={**dynamic, "logits": _logit_axes(task)},
            )  # fmt: skip
        _check_runs(graph, wrapper, sample)  # tracing may have fixed a size that must stay free
        return "torchscript"
    except Exception as err:
        torchscript_error = _what_failed(err)
    where = _module_of(wrapper, sample, dims, _operator(f"{dynamo_error} {torchscript_error}"))
    raise ExportError(
        f"torch cannot export this model to ONNX{where}. dynamo exporter: {dynamo_error}. "
        f"TorchScript exporter: {torchscript_error}"
    )


def _operator(message: str) -> str | None:
    """The operator an exporter's message names ("op='prims.bessel_j0'", "operator 'aten::foo'")."""
    found = re.search(r"op='([\w.:]+)'|operator '([\w.:]+)'", message)
    if not found:
        return None
    return re.split(r"[.:]+", found.group(1) or found.group(2))[-1]


def _module_of(wrapper, sample, dims, operator: str | None) -> str:
    """' (operator X in module Y, a Z)': where the model calls the operator that failed, read from the
    graph torch.export traces (each node knows the module it ran in); '' where that cannot be told."""
    if operator is None:
        return ""
    key = operator.removeprefix("special_")
    try:
        with _quiet():
            traced = torch.export.export(wrapper, sample, dynamic_shapes=dims)
    except Exception:  # noqa: BLE001 (a model torch.export cannot trace: the operator alone is said)
        return f" (operator {operator})"
    for node in traced.graph.nodes:
        if node.op == "call_function" and key in str(node.target):
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            if stack:
                path, kind = stack[-1]
                path = path.removeprefix("L['self'].")
                path = "" if path == "model" else path.removeprefix("model.")  # the wrapper's own attribute
                where = f"module {path}" if path else "the model's own forward"
                name = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
                return f" (operator {operator} in {where}, a {name})"
    return f" (operator {operator})"


def _logit_axes(task: str) -> dict[int, str]:
    return {0: "batch", 1: "sequence"} if task == "causal-lm" else {0: "batch"}


def _check_runs(graph: Path, wrapper, sample: tuple) -> None:
    """onnxruntime loads the graph and runs it at another batch size (and sequence length) than it was
    traced with, with padding in the attention mask where there is one (the trace saw none), giving torch's
    logits; else an ExportError saying what went wrong."""
    import onnxruntime

    other = tuple(_resized(t) for t in sample)
    if len(other) > 1 and not other[1].dtype.is_floating_point:  # the attention mask: a padded row
        other[1][0, -2:] = 0
    try:
        session = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's own types
        raise ExportError(f"onnxruntime cannot load the exported graph: {_what_failed(err)}") from None
    taken = [i.name for i in session.get_inputs()]
    if len(taken) != len(other):  # the trace never read an input: what the model did with it is gone
        raise ExportError(
            f"the exported graph takes {len(taken)} of the {len(other)} inputs ({', '.join(taken)}): the "
            "others were dropped, their use fixed when it was traced (the model read them only in a branch "
            "the example batch did not take, or not at all)"
        )
    try:
        feed = {name: t.numpy() for name, t in zip(taken, other, strict=True)}
        got = session.run(None, feed)[0]  # the logits (a cache graph's present key/values follow)
    except Exception as err:  # onnxruntime's own types
        raise ExportError(f"onnxruntime cannot run the exported graph: {_what_failed(err)}") from None
    with torch.inference_mode():
        expected = wrapper(*other)
    if isinstance(expected, tuple):
        expected = expected[0]
    if tuple(got.shape) != tuple(expected.shape):
        raise ExportError(
            f"the exported graph gives logits of shape {list(got.shape)} for inputs of another size, torch "
            f"{list(expected.shape)}: a size was fixed when it was traced"
        )
    got = torch.from_numpy(got).float()
    if not torch.allclose(got, expected.float(), atol=1e-3, rtol=1e-3, equal_nan=True):
        gap = float((got - expected.float()).abs().nan_to_num(0).max())
        raise ExportError(
            f"the exported graph's logits differ from torch's by up to {gap:.3g} for a padded batch of "
            "another size: a branch of the model (its use of the attention mask, or a size) was fixed "
            "when it was traced"
        )


def _resized(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with one more row (and, for a token sequence, three more positions)."""
    rows = torch.cat([tensor, tensor[:1]])
    if tensor.dtype.is_floating_point or tensor.dim() < 2:
        return rows
    return torch.cat([rows, rows[:, -3:]], dim=1)


def _what_failed(err: Exception) -> str:
    """The line of torch's message that names what failed (an operator, a module), shortened: from the
    deepest cause, where the dynamo exporter's outer errors only say which step failed."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # its terminal colours
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(mark in line for mark in ("aten::", "aten.", "Unsupported", "not supported", "operator")):
            return line[:400]
    return (lines[0] if lines else type(err).__name__)[:400]


@contextlib.contextmanager
def _quiet():
    """torch's exporters print progress and warnings of their own: kept out of the user's terminal (and
    shown with --verbose through the logger)."""
    sink = io.StringIO()
    # onnxruntime's quantization logs its advice on the root logger ("")
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir", "")]
    levels = [logger.level for logger in loggers]
    # a message logged on the root logger with no handler makes `logging` add one (basicConfig), which
    # would then print every gpuforge line twice: a handler that drops them stands there meanwhile
    guard = logging.NullHandler()
    logging.getLogger().addHandler(guard)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
            logging.getLogger().removeHandler(guard)
            if sink.getvalue():
                log.debug("torch.onnx: %s", sink.getvalue())


def _quantize_int8(graph: Path, target: Path, big: bool) -> Path:
    """onnxruntime's dynamic quantization: int8 weights, activations quantized per batch as it runs. One
    scale per output channel: with one per tensor the MiniLM classifier lost a point of accuracy, per
    channel none, at the same speed."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target.parent.mkdir()
    try:
        with _quiet():
            quantize_dynamic(
                str(graph), str(target), weight_type=QuantType.QInt8, per_channel=True,
                use_external_data_format=big,
            )  # fmt: skip
    except Exception as err:  # onnxruntime's own types
        raise ExportError(
            f"--quantize int8: onnxruntime could not quantize the graph: {_what_failed(err)}"
        ) from None
    return target


def _manifest(
    source: Manifest, model_dir: Path, opset: int, exporter: str, names, quantize, files, positions
):
    """The source's manifest as an export's: format onnx, a full model (an adapter is merged), its graph."""
    content: dict[str, Any] = source.to_dict()
    for adapter_field in ("base", "lora_targets", "modules_to_save", "quantize_base"):
        content.pop(adapter_field, None)
    onnx = OnnxRecord.model_validate(
        {
            "file": GRAPH,
            "opset": opset,
            "exporter": exporter,
            "inputs": names,
            "quantize": quantize,
            "from": str(model_dir.resolve()),
            "files": files,
            "max_positions": positions,
        }  # fmt: skip
    )
    content.update(format="onnx", kind="full", weights=GRAPH, precision="int8" if quantize else "fp32")
    manifest = Manifest.model_validate(content)
    manifest.onnx = onnx
    return manifest
