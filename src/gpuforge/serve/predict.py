"""What an endpoint runs: a trained classifier loaded from a run's model/ directory, one batch at a time.

    predictor = load_predictor("runs/x/model", device="auto", precision="auto", quantize=None)
    item = predictor.check(raw_input)          # in the request: bad input is an InputError (a 4xx)
    results = predictor.run_batch([item, ...])  # in the model thread: one result per item

Text models tokenize the whole batch at once and pad it to its own longest input (not to a fixed
length); an input longer than `max_length` tokens is truncated and its result says so. Image models take
each input as nested lists of numbers in the training shape (C x H x W, or H x W for one channel).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuforge.artifact import Manifest, built_from, load_artifact, read_manifest
from gpuforge.errors import GpuforgeError
from gpuforge.hardware.probe import select_device
from gpuforge.runtime import tasks
from gpuforge.runtime.device_share import cap_cuda_memory
from gpuforge.runtime.precision import Precision, autocast, choose_precision
from gpuforge.serve.adapters import OWN, Adapters, check_adapters
from gpuforge.serve.batch_precision import PrecisionPlan, plan_precision

log = logging.getLogger("gpuforge.serve")
MAX_TEXT_CHARS = 100_000  # past this an input is refused before it is tokenized (a 413)


class InputError(GpuforgeError):
    """One input the model cannot take; `status` is the HTTP answer (422, or 413 for one too large)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


@dataclass
class Predictor:
    module: torch.nn.Module
    tokenizer: Any
    manifest: Manifest
    device: torch.device
    precision: Precision
    max_length: int | None
    quantized: str | None = None
    adapters: Adapters | None = None  # several LoRA adapters on this base (serve/adapters.py)
    backend: str = "torch"  # or onnxruntime (an ONNX export: gpuforge export)
    quantize_report: dict[str, Any] | None = None  # the eval metric before and after --quantize
    eval_result: dict[str, Any] | None = None  # the eval metric as served (--eval-at-load)
    tokens_read: int = 0  # real tokens (padding not counted) of every text batch so far, for /metrics
    last_split: tuple[float, float, float] | None = None  # the last batch's tokenize, forward, scores (s)
    plan: PrecisionPlan | None = None  # which copy of the model, in which precision, runs a batch of n

    @property
    def task(self) -> str:
        return self.manifest.task

    @property
    def labels(self) -> list[str]:
        n = self.manifest.num_labels or 0
        return self.manifest.labels or [str(i) for i in range(n)]

    @property
    def name(self) -> str:
        return self.manifest.job or "model"

    def check(self, raw: Any) -> Any:
        """One input as the model takes it, or an InputError naming what is wrong."""
        if self.task == "image-classification":
            return self._check_image(raw)
        if not isinstance(raw, str):
            raise InputError(f"each input must be a string of text, got {type(raw).__name__}")
        if not raw.strip():
            raise InputError("an input is empty")
        if len(raw) > MAX_TEXT_CHARS:
            raise InputError(f"an input has {len(raw)} characters, over the {MAX_TEXT_CHARS} allowed", 413)
        return raw

    def _check_image(self, raw: Any) -> torch.Tensor:
        shape = tuple(self.manifest.sample_shape or ())
        try:
            pixels = torch.as_tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise InputError(f"an image input must be nested lists of numbers ({err})") from None
        if shape and pixels.shape != shape:
            if len(shape) == 3 and shape[0] == 1 and pixels.shape == shape[1:]:
                pixels = pixels.unsqueeze(0)  # one channel may come without its axis
            else:
                want = " x ".join(map(str, shape))
                raise InputError(f"an image input has shape {list(pixels.shape)}, the model takes {want}")
        if not torch.isfinite(pixels).all():
            raise InputError("an image input holds NaN or infinity")
        return pixels

    def run_batch(self, items: list[tuple[str | None, Any]]) -> list[dict[str, Any] | InputError]:
        """Results for (adapter name or None, checked input) pairs; one forward pass for all of them. An
        input naming an adapter removed since its request came gets an InputError (404) instead."""
        names = [name or OWN for name, _ in items]
        labels = self.adapters.ready(set(names)) if self.adapters is not None else {OWN: self.labels}
        if all(name in labels for name in names):
            return self._forward([payload for _, payload in items], names, labels)
        kept = [i for i, name in enumerate(names) if name in labels]
        answers = iter(self._forward([items[i][1] for i in kept], [names[i] for i in kept], labels))
        return [next(answers) if n in labels else InputError(self.adapters.unknown(n), 404) for n in names]

    def _forward(self, payloads: list[Any], names: list[str], labels: dict[str, list[str]]):
        if not payloads:
            return []
        began = time.perf_counter()
        batch, truncated = self._collate(payloads)
        collated = time.perf_counter()
        module, precision = self.plan.for_batch(len(payloads)) if self.plan else (self.module, self.precision)
        logits = self._logits(module, precision, batch, names)
        probs = torch.softmax(logits.float(), dim=-1).cpu()  # .cpu() waits for the device: forward's end
        forwarded = time.perf_counter()
        results = []
        for row, cut, name in zip(probs.tolist(), truncated, names, strict=True):
            tags = labels[name]
            best = max(range(len(row)), key=row.__getitem__)
            result = {"label": _label(tags, best), "score": row[best]}
            result["scores"] = {_label(tags, i): p for i, p in enumerate(row)}
            if cut:
                result["truncated"] = True
            results.append(result)
        self.last_split = (collated - began, forwarded - collated, time.perf_counter() - forwarded)
        return results

    def _logits(
        self, module: torch.nn.Module, precision: Precision, batch: dict[str, torch.Tensor], names: list[str]
    ) -> torch.Tensor:
        with torch.inference_mode(), autocast(precision, self.device):
            if self.adapters is None or set(names) == {OWN}:  # the active adapter alone: the plain path
                return tasks.forward(built_from(module, self.manifest), self.task, batch)
            # rows of one batch may each name another adapter: PEFT routes them
            out = module(**batch, adapter_names=self.adapters.peft_names(names))
            return out.logits if hasattr(out, "logits") else out

    def time_batch(self, module: torch.nn.Module, precision: Precision, size: int) -> None:
        """One batch of `size` made-up inputs through `module` in `precision`, to its end: what
        serve/batch_precision.py times to choose a precision."""
        batch, _ = self._collate(self._made_up(size, words=12))
        self._logits(module, precision, batch, [OWN] * size).float().cpu()

    def _collate(self, items: list[Any]) -> tuple[dict[str, torch.Tensor], list[bool]]:
        if self.task == "image-classification":
            return {"pixel_values": torch.stack(items).to(self.device)}, [False] * len(items)
        encoded = self.tokenizer(
            list(items), padding=True, truncation=self.max_length is not None, max_length=self.max_length,
            return_tensors="pt", return_overflowing_tokens=False, return_length=False,
        )  # fmt: skip
        lengths = encoded["attention_mask"].sum(dim=1)
        self.tokens_read += int(lengths.sum())
        truncated = [bool(n >= self.max_length) for n in lengths] if self.max_length else [False] * len(items)
        batch = {k: v.to(self.device) for k, v in encoded.items() if k in ("input_ids", "attention_mask")}
        return batch, truncated

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 8)) -> None:
        """Run the model on made-up inputs so the first request does not pay for lazy set-up."""
        if not self.can_make_up_inputs:
            return
        for n in batch_sizes:
            self.run_batch([(None, item) for item in self._made_up(n)])

    @property
    def can_make_up_inputs(self) -> bool:
        """Whether warm-up and timing can make inputs: an image model needs its training shape."""
        return self.task != "image-classification" or bool(self.manifest.sample_shape)

    def _made_up(self, size: int, words: int = 0) -> list[Any]:
        """`size` inputs the model takes: zeros in the training shape, or texts of `words` + 1 to 7 words."""
        if self.task == "image-classification":
            return [torch.zeros(tuple(self.manifest.sample_shape or ()))] * size
        return [" ".join(["warm up"] * (i % 7 + 1) + ["made-up"] * words) for i in range(size)]


def _label(labels: list[str], index: int) -> str:
    return labels[index] if index < len(labels) else str(index)


def load_predictor(
    model_dir: str | Path,
    device: str = "auto",
    precision: str = "auto",
    quantize: str | None = None,
    max_length: int | None = None,
    adapters: dict[str, Path] | None = None,
    max_adapters: int = 8,
    eval_at_load: bool = False,
    max_batch: int = 32,
) -> Predictor:
    model_dir = Path(model_dir)
    if not (model_dir / "gpuforge.json").is_file():
        raise GpuforgeError(f"{model_dir}: not a gpuforge model directory (no gpuforge.json)")
    manifests = check_adapters(model_dir, adapters or {})
    if adapters and quantize:
        raise GpuforgeError("--quantize with --adapter: quantizing merges one adapter into the base")
    torch_device = select_device(device)
    cap_cuda_memory(torch_device)  # a replica on a fraction of a GPU: held to its share of the memory
    stored = read_manifest(model_dir)
    if stored.format == "onnx":
        _check_onnx(model_dir, stored, quantize, adapters)
        precision = "fp32"  # the graph's own: int8 where the export quantized it, else fp32
    merge_qlora = bool(quantize and stored.quantize_base)  # merged onto a dequantized base first
    module, tokenizer, manifest = load_artifact(model_dir, torch_device, dequantize_base=merge_qlora)
    if manifest.task == "causal-lm":
        raise GpuforgeError(f"{model_dir}: a causal-lm model; this release serves classifiers only")
    chosen = choose_precision(precision, torch_device)
    asker = "--quantize" if quantize else "--eval-at-load"
    eval_data = _eval_data(model_dir, asker) if quantize or eval_at_load else None
    before = _metric(module, manifest, eval_data, chosen, torch_device) if quantize else None
    if quantize:
        module = _quantize(module, manifest, quantize)
    length = max_length or manifest.max_length
    positions = getattr(getattr(module, "config", None), "max_position_embeddings", None) or (
        manifest.onnx.max_positions if manifest.onnx else None
    )
    if length is not None and positions:
        length = min(length, positions)
    log.info("serving %s (%s) on %s", model_dir, manifest.task, torch_device)
    quantized = quantize or manifest.quantization or (manifest.onnx.quantize if manifest.onnx else None)
    predictor = Predictor(module, tokenizer, manifest, torch_device, chosen, length, quantized)
    if manifest.format == "onnx":
        predictor.backend = f"onnxruntime ({module.provider})"
        predictor.device = module.device  # a CPU-only onnxruntime on a GPU machine runs on the CPU
        log.info("precision: the graph's own (%s)", predictor.quantized or "fp32")
    alone = manifest.is_adapter and not quantize  # the adapters' PEFT model: one copy, changed in place
    if manifest.format != "onnx":
        timed = predictor.time_batch if predictor.can_make_up_inputs else None
        castable = not (quantized or manifest.quantize_base)  # a 4-bit QLoRA base stays as it is
        plan = plan_precision(precision, chosen, module, timed, max_batch, alone, castable)
        predictor.module, predictor.precision, predictor.plan = plan.module, plan.precision, plan
        log.info("precision: %s (%s)", plan.describe()["rule"], plan.precision.reason)
    # as served: after any --quantize, in the precision full batches run in
    served = _metric(predictor.module, manifest, eval_data, predictor.precision, torch_device)
    predictor.quantize_report = _metric_change(before, served, eval_data) if quantize else None
    if predictor.quantize_report is not None:
        log.info("--quantize %s: %s", quantize, predictor.quantize_report["summary"])
    if eval_at_load and served is not None:
        metric = _metric_name(served)
        predictor.eval_result = {"metric": metric, "value": served[metric], "examples": len(eval_data)}
        log.info("--eval-at-load: eval %s %.4f (%d examples)", metric, served[metric], len(eval_data))
    if alone:  # its own adapter, and any others on the same base
        adapters = adapters or {}
        predictor.adapters = Adapters(predictor.module, predictor.labels, adapters, manifests, max_adapters)
    return predictor


def _check_onnx(model_dir: Path, manifest: Manifest, quantize: str | None, adapters) -> None:
    """What an ONNX export cannot do behind an endpoint, refused before it loads."""
    if manifest.task == "causal-lm":
        if manifest.onnx is not None and manifest.onnx.cache is not None:
            raise GpuforgeError(
                f"{model_dir}: an ONNX export of a causal LM, which answers the completion routes "
                "(gpuforge serve), not /predict"
            )
        why = manifest.onnx.no_cache if manifest.onnx else None
        raise GpuforgeError(
            f"{model_dir}: an ONNX export of a causal LM's logits alone, without the key/value cache to "
            f"generate with{f' ({why})' if why else ''}: serve the model directory it came from"
        )
    if quantize:
        raise GpuforgeError("--quantize: an ONNX export; quantize it with gpuforge export --quantize int8")
    if adapters:
        raise GpuforgeError(
            "--adapter: an ONNX export has its adapter merged in; export each adapter's model"
        )


def _quantize(module: torch.nn.Module, manifest: Manifest, kind: str) -> torch.nn.Module:
    """Post-training weight-only quantization at load (weights/quantize.py); an adapter is merged first."""
    if manifest.quantization:
        raise GpuforgeError("--quantize: this model directory is quantized already (gpuforge compress)")
    if manifest.is_adapter:
        from gpuforge.weights.merge import merge_adapter

        module = merge_adapter(module)
    from gpuforge.weights.quantize import quantize_model

    done = quantize_model(module, kind)
    log.info("quantized %d layers to %s (%d left in float)", len(done.quantized), kind, len(done.skipped))
    return module


def _eval_data(model_dir: Path, asker: str):
    """The run's held-out split (rebuilt from the run's spec.yaml beside model/), or None without one
    (logged, naming the flag `asker` that wanted it)."""
    from gpuforge.artifact.origin import ArtifactError, open_source

    try:
        return open_source(model_dir).data.eval
    except (ArtifactError, GpuforgeError, OSError) as err:
        log.warning("%s: no held-out split to measure on (%s)", asker, err)
        return None


def _metric(module, manifest, eval_data, precision, device) -> dict[str, float] | None:
    if eval_data is None:
        return None
    from gpuforge.runtime.evaluate import evaluate

    return evaluate(built_from(module, manifest), manifest.task, eval_data, 32, precision, device)


def _metric_change(before, after, eval_data) -> dict[str, Any]:
    if before is None or after is None:
        return {"summary": "no eval set beside the model: the accuracy change is not measured"}
    name = _metric_name(before)
    delta = after[name] - before[name]
    summary = f"eval {name} {before[name]:.4f} -> {after[name]:.4f} ({delta:+.4f}, {len(eval_data)} examples)"
    return {"metric": name, "before": before[name], "after": after[name], "delta": delta,
            "examples": len(eval_data), "summary": summary}  # fmt: skip


def _metric_name(result: dict[str, float]) -> str:
    return "accuracy" if "accuracy" in result else "perplexity"
