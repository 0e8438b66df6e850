"""Compress a trained model: merge -> prune (-> recover) -> quantize, then measure and save each variant.

    gpuforge compress runs/digits/model --prune 0.5 --quantize int8 --recover-steps 100 --out runs/digits/c
    gpuforge compress runs/digits/model --sweep --out runs/digits/sweep

The order is fixed because each step needs the one before: pruning and quantizing act on plain weights,
so an adapter is merged first; recovery trains float weights, so it runs before quantization. Every
variant is a model directory that load_artifact reads (gpuforge.json says what was done and how to load
it), plus report.json beside it. The eval set is the run's own held-out split, rebuilt from the
run's spec.yaml with its seed, so the metric is the one the run reported.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_model
from torch import nn

from gpuforge.artifact import built_from, load_artifact
from gpuforge.artifact.manifest import (
    Compression,
    Manifest,
    PruneRecord,
    QuantizeRecord,
    RecoverRecord,
    write_manifest,
)
from gpuforge.artifact.origin import Source, open_source
from gpuforge.compress import report
from gpuforge.compress.options import CompressError, CompressOptions
from gpuforge.compress.prune import magnitude_prune, prune_channels
from gpuforge.compress.recover import recover
from gpuforge.errors import GpuforgeError
from gpuforge.hardware.timing import Timing
from gpuforge.models.base import BuiltModel
from gpuforge.spec import JobSpec
from gpuforge.train.lr_find import found_lr
from gpuforge.weights.merge import merge_adapter
from gpuforge.weights.quantize import QUANT_KINDS, quantize_model, save_quantized, tensor_bytes

log = logging.getLogger("gpuforge.compress")
QUANTIZED_WEIGHTS = "quantized.pt"
FALLBACK_LR = 5e-5  # recovery of a merged adapter, or of a run whose picked rate is not on record


def make_variant(source: Source, options: CompressOptions) -> tuple[BuiltModel, Any, Manifest]:
    """(the compressed model, its tokenizer, its manifest saying what was done) for `options`, in memory."""
    if source.is_adapter and (options.prune or options.quantize) and not options.merge:
        options = options.model_copy(update={"merge": True})  # pruning and quantizing act on plain weights
        log.info("the run trained a LoRA adapter: merging it first")
    _refuse_merge_without_adapter(source, options)
    module, tokenizer, manifest = load_artifact(
        source.model_dir, dequantize_base=options.merge and bool(source.manifest.quantize_base)
    )
    done = Compression(from_=str(source.model_dir.resolve()), options=options.model_dump(), name=options.name)
    if options.merge:
        module = merge_adapter(module)
        done.merged = True
    if options.prune:
        if options.prune_structure == "channel":
            pruned = prune_channels(module, options.prune)
        else:
            pruned = magnitude_prune(module, options.prune, options.prune_structure)
        done.prune = PruneRecord(
            structure=pruned.structure,
            amount=pruned.amount,
            layers=len(pruned.pruned),
            skipped=pruned.skipped,
            resized=pruned.resized,
            config=pruned.config,
        )
        if options.recover_steps:
            lr = options.recover_lr or (FALLBACK_LR if source.is_adapter else _trained_lr(source))
            losses = recover(
                built_from(module, manifest),
                source.spec,
                source.data.train,
                options.recover_steps,
                lr,
                pruned.masks,
            )
            done.recover = RecoverRecord(
                steps=options.recover_steps, lr=lr, first_loss=losses[0], last_loss=losses[-1]
            )
    counts = report.count_parameters(module)
    if options.quantize:
        layers = dict(module.named_modules())
        kinds = (nn.Linear, nn.Embedding, nn.Conv2d)
        before = {name: tensor_bytes(m) for name, m in layers.items() if isinstance(m, kinds)}
        result = quantize_model(module, options.quantize)
        done.quantize = QuantizeRecord(
            kind=result.kind, layers=len(result.quantized), skip=list(result.skipped)
        )
        done.quantize_skipped = result.skipped
        if result.quantized:
            after = sum(tensor_bytes(module.get_submodule(name)) for name in result.quantized)
            done.touched_ratio = after / sum(before[name] for name in result.quantized)
    done.params, done.nonzero_params = counts
    return built_from(module, manifest), tokenizer, manifest.model_copy(update={"compression": done})


def _refuse_merge_without_adapter(source: Source, options: CompressOptions) -> None:
    if options.merge and not source.is_adapter:
        raise CompressError("--merge: this run trained the full model, there is no adapter to merge")


def save_variant(built: BuiltModel, tokenizer, manifest: Manifest, out: Path) -> None:
    """Write a variant as a model directory (written beside, then moved into place)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module = built.module
    if manifest.quantization:
        # the float skeleton is rebuilt from its config or builder, then quantized and filled from here
        if built.is_transformers:
            module.config.save_pretrained(str(tmp))
        save_quantized(module, tmp / QUANTIZED_WEIGHTS)
        weights = QUANTIZED_WEIGHTS
    elif built.is_transformers:
        module.save_pretrained(str(tmp))
        weights = "model.safetensors"
    else:
        save_model(module, str(tmp / "model.safetensors"))
        weights = "model.safetensors"
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    # a standalone model now: no adapter, no base to load it on
    standalone = {
        "format": "transformers" if built.is_transformers else "state_dict",
        "kind": "full",
        "base": None,
        "quantize_base": None,
        "weights": weights,
    }
    write_manifest(tmp, manifest.model_copy(update=standalone))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not force:
        raise CompressError(f"--out {out}: exists and is not empty; pass --force to overwrite it")


def _opened(model_dir, spec_path) -> Source:
    source = open_source(model_dir, spec_path)
    if source.manifest.format == "onnx":  # no torch weights to prune or quantize
        raise CompressError(
            f"{model_dir}: an ONNX export; compress the model directory it came from "
            f"({source.manifest.onnx.from_ if source.manifest.onnx else 'see its gpuforge.json'})"
        )
    return source


def _original_row(source: Source) -> tuple[dict[str, Any], dict[int, Timing]]:
    """The original's row and its latencies, to compare with the same model timed after the variants."""
    module, _, manifest = load_artifact(source.model_dir)
    built = built_from(module, manifest)
    module.eval()
    timings = report.latencies(built, source.spec.model.task, source.data.eval)
    row = report.measure(
        "original", built, source.spec.model.task, source.data.eval, report.count_parameters(module),
        report.directory_bytes(source.model_dir), {"adapter": source.is_adapter}, timings,
    )  # fmt: skip
    return row, timings


def _front(source: Source, rows: list[dict[str, Any]], first: dict[int, Timing]) -> None:
    """The original timed again, reloaded rather than held beside every variant (how far the machine
    moved meanwhile widens every spread), then the deltas and the front, which decides nothing on a
    difference inside a spread."""
    module, _, manifest = load_artifact(source.model_dir)
    module.eval()
    again = report.latencies(built_from(module, manifest), source.spec.model.task, source.data.eval)
    report.add_drift(rows, first, again)
    report.add_deltas_and_front(rows)


def compress(
    model_dir: str | Path, options: CompressOptions, out: str | Path, force: bool = False, spec_path=None
) -> list[dict[str, Any]]:
    """One variant, saved to `out`, with report.json holding the original and the variant."""
    out = Path(out)
    _check_out(out, force)
    source = _opened(model_dir, spec_path)
    _refuse_merge_without_adapter(source, options)  # before the original is loaded and timed, not after
    original, first = _original_row(source)
    rows = [original, _variant_row(source, options, out)]
    _front(source, rows, first)
    (out / "report.json").write_text(json.dumps({"variants": rows}, indent=2) + "\n")
    return rows


def _variant_row(source: Source, options: CompressOptions, out: Path) -> dict[str, Any]:
    built, tokenizer, manifest = make_variant(source, options)
    save_variant(built, tokenizer, manifest, out)
    done = manifest.compression
    skipped = {**(done.prune.skipped if done.prune else {}), **(done.quantize_skipped or {})}
    return report.measure(
        done.name, built, source.spec.model.task, source.data.eval,
        (done.params, done.nonzero_params), report.directory_bytes(out),
        {"path": str(out), "skipped": skipped, "touched_ratio": done.touched_ratio},
    )  # fmt: skip


def _onnx_row(source: Source, name: str, quantize: str | None, out: Path, original: dict) -> dict[str, Any]:
    """The ONNX export of the source model (gpuforge export), measured as the torch variants are: by
    onnxruntime, behind the same module interface."""
    from gpuforge.export.onnx import export_onnx
    from gpuforge.export.parity import graph_bytes

    export_onnx(source.model_dir, out, quantize)
    module, _, manifest = load_artifact(out)
    graph = graph_bytes(out)
    row = report.measure(
        name, built_from(module, manifest), source.spec.model.task, source.data.eval,
        (original["params"], original["nonzero_params"]), report.directory_bytes(out),
        {"path": str(out), "runtime": f"onnxruntime ({module.provider})"},
    )  # fmt: skip
    row["memory_bytes"] = graph  # the graph's weights, which onnxruntime holds (the module has no tensors)
    return row


def sweep_options(source: Source, recover_steps: int) -> list[CompressOptions]:
    """The useful combinations: each quantization alone, each pruning (recovered when asked), and the
    two that stack best (channel pruning + int8, 50 % unstructured + int8)."""
    merge = source.is_adapter

    def pruned(amount: float, structure: str, quantize: str | None = None) -> CompressOptions:
        return CompressOptions(
            prune=amount,
            prune_structure=structure,
            quantize=quantize,
            merge=merge,
            recover_steps=recover_steps,
        )

    variants = [CompressOptions(merge=True)] if merge else []
    variants += [CompressOptions(quantize=kind, merge=merge) for kind in QUANT_KINDS]
    variants += [
        pruned(0.5, "unstructured"),
        pruned(0.5, "2:4"),
        pruned(0.3, "channel"),
        pruned(0.3, "channel", "int8"),
        pruned(0.5, "unstructured", "int8"),
    ]
    return variants


def sweep(
    model_dir: str | Path,
    out: str | Path,
    recover_steps: int = 0,
    force: bool = False,
    spec_path=None,
    onnx: bool = False,
) -> list[dict[str, Any]]:
    """Every variant of sweep_options under out/<name>/, and out/report.json with the Pareto front; with
    `onnx`, the ONNX exports too (fp32 and int8, run by onnxruntime). A variant that fails is reported
    with its error and the sweep goes on."""
    out = Path(out)
    _check_out(out, force)
    source = _opened(model_dir, spec_path)
    return run_variants(source, sweep_options(source, recover_steps), out, ONNX_VARIANTS if onnx else ())


ONNX_VARIANTS = (None, "int8")  # gpuforge export's quantizations: none (fp32), onnxruntime's dynamic int8


def run_variants(
    source: Source, variants: list[CompressOptions], out: Path, onnx: tuple[str | None, ...] = ()
) -> list[dict[str, Any]]:
    """The original and each variant (under out/<name>/), measured; out/report.json with the front.
    A variant that fails is reported with its error and the others go on."""
    original, first = _original_row(source)
    rows = [original]
    failed = []
    for options in variants:
        log.info("variant %s", options.name)
        try:
            rows.append(_variant_row(source, options, out / options.name.replace(":", "_")))
        except GpuforgeError as err:
            failed.append({"name": options.name, "error": str(err)})
            log.warning("variant %s failed: %s", options.name, err)
    for quantize in onnx:
        name = f"onnx-{quantize or 'fp32'}"
        log.info("variant %s", name)
        try:
            rows.append(_onnx_row(source, name, quantize, out / name, rows[0]))
        except GpuforgeError as err:
            failed.append({"name": name, "error": str(err)})
            log.warning("variant %s failed: %s", name, err)
    _front(source, rows, first)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"variants": rows, "failed": failed}, indent=2) + "\n")
    return rows


def compress_run(spec: JobSpec, run_dir: str | Path) -> list[dict[str, Any]] | None:
    """The spec's `compress:` section, run on a finished run: <run>/compressed, an event in events.jsonl."""
    from gpuforge.runs import RunDir

    wanted = spec.compress
    if not wanted.requested:
        return None
    run = RunDir(run_dir)
    out = run.compressed_dir
    spec_path = run.root / "spec.yaml"
    if wanted.sweep:
        steps = wanted.prune.recover_steps if wanted.prune else 0
        rows = sweep(run.model_dir, out, steps, force=True, spec_path=spec_path, onnx=wanted.onnx)
    elif wanted.onnx:  # the exports alone, beside the original
        _check_out(out, force=True)
        rows = run_variants(_opened(run.model_dir, spec_path), [], out, ONNX_VARIANTS)
    else:
        options = CompressOptions.from_spec(wanted)
        rows = compress(run.model_dir, options, out, force=True, spec_path=spec_path)
    run.event("compressed", path=str(out.relative_to(run.root)), variants=[r["name"] for r in rows[1:]])
    return rows


def _trained_lr(source: Source) -> float:
    """The rate the run trained at: train.lr, or for auto the one its range test picked (lr_find.json),
    else the fine-tuning default with a warning."""
    if source.spec.train.lr != "auto":
        return source.spec.train.lr
    found = found_lr(source.run_dir)
    if found is None:
        log.warning("train.lr auto; %s has no lr_find.json: recovery at %g", source.run_dir, FALLBACK_LR)
    return found or FALLBACK_LR
