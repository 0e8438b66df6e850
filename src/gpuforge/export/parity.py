"""Parity of an export with the torch model it came from, measured, not assumed: the run's held-out split
through both (max absolute difference of the logits, how often they pick the same class, the task metric
of each), bytes, and latency at batch 1 and 32 on this machine. Written as export_report.json. A causal LM
exported with its key/value cache is also run as generation runs it (decode): held-out prompts of different
lengths, left-padded, then greedy steps with each side's own cache, the logits compared at every step.

Latency is timed as hardware/timing.py times everything (repeated until its spread is small, or a time
cap): `latency_ms` holds each figure (ms for the whole batch), `latency_spread` its spread, widened to at
least `latency_drift`, how far torch at batch 1 moved between first and last (the machine's load), and
`latency_waited` the share of the time its threads waited for a CPU; a figure timing.py calls unreliable
is shown as such.

Floors the report checks (and says where they are missed): an fp32 export agrees to 1e-4; an int8 one stays
within 1 point of the task metric in at most 0.3x the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpuforge.artifact import Manifest, built_from, load_artifact
from gpuforge.artifact.origin import open_source
from gpuforge.data.batches import micro_batches
from gpuforge.errors import GpuforgeError
from gpuforge.export.onnx import GRAPH, REPORT, decode_gap
from gpuforge.hardware.timing import MAX_SECONDS, Timing, said, spread_between, time_until_steady
from gpuforge.runtime import tasks

FP32_TOLERANCE = 1e-4
INT8_METRIC_POINTS = 1.0  # accuracy points (0.01); perplexity: 1 % of the torch model's
INT8_BYTES_RATIO = 0.3
BATCH = 32
DECODE_PROMPTS, DECODE_STEPS = 8, 8


def measure_parity(
    model_dir: Path, export_dir: Path, torch_built, manifest: Manifest, max_seconds: float = MAX_SECONDS
) -> dict:
    """The report for the export in `export_dir` of the model in `model_dir` (loaded as `torch_built`);
    `max_seconds`: the cap on timing each latency figure."""
    onnx_module, _, exported = load_artifact(export_dir)
    onnx_built = built_from(onnx_module, exported)
    task = manifest.task
    report: dict[str, Any] = {
        "format": "onnx",
        "from": str(Path(model_dir).resolve()),
        "exporter": exported.onnx.exporter,
        "opset": exported.onnx.opset,
        "quantize": exported.onnx.quantize,
        "provider": onnx_module.provider,
        "threads": torch.get_num_threads(),
        "notes": [],
    }
    try:
        data = open_source(model_dir, _spec_of(Path(model_dir), manifest)).data.eval
    except (GpuforgeError, OSError) as err:
        data = None
        report["notes"].append(f"no held-out split to measure on ({err}): parity and metric unmeasured")
    if data is not None:
        report.update(_agreement(task, data, torch_built, onnx_built))
        if exported.onnx.cache is not None:
            report["decode"] = _decode_agreement(torch_built.module, onnx_module, data)
    report["bytes"] = {"torch": _state_bytes(torch_built.module), "onnx": graph_bytes(export_dir)}
    report["bytes"]["ratio"] = report["bytes"]["onnx"] / max(1, report["bytes"]["torch"])
    if data is not None:
        report.update(_latencies({"torch": torch_built, "onnx": onnx_built}, task, data, max_seconds))
    report["checks"] = _checks(report)
    (export_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _spec_of(model_dir: Path, manifest: Manifest) -> Path | None:
    """The run's spec: beside the model directory, or for a compressed variant beside the model it was
    made from (gpuforge.json's compression.from)."""
    if (model_dir.parent / "spec.yaml").is_file() or manifest.compression is None:
        return None  # open_source's own default
    origin = manifest.compression.from_
    return Path(origin).parent / "spec.yaml" if origin else None


def _agreement(task: str, data, torch_built, onnx_built) -> dict[str, Any]:
    torch_tally, onnx_tally = tasks.EvalTally(task), tasks.EvalTally(task)
    worst, same, rows = 0.0, 0, 0
    with torch.inference_mode():
        for chunk in micro_batches(list(range(len(data))), BATCH):
            batch = data.collate(chunk)
            expected, got = _full(torch_built, task, batch), _full(onnx_built, task, batch)
            torch_tally.add(expected, batch)
            onnx_tally.add(got, batch)
            if task == "causal-lm":  # padded positions carry no meaning: compared where the mask is 1
                mask = batch.get("attention_mask", torch.ones(expected.shape[:2])).bool()
                expected, got = expected[mask], got[mask]
            worst = max(worst, float((expected - got).abs().max()))
            same += int((expected.argmax(-1) == got.argmax(-1)).sum())
            rows += expected.shape[0]
    name = "perplexity" if task == "causal-lm" else "accuracy"
    before, after = torch_tally.result()[name], onnx_tally.result()[name]
    return {
        "examples": len(data),
        "max_abs_diff": worst,
        "argmax_agreement": same / max(1, rows),
        "metric": {"name": name, "torch": before, "onnx": after, "delta": after - before},
    }


def _decode_agreement(model, onnx_module, data) -> dict[str, Any]:
    """Prompts cut from the first held-out rows at lengths 2, 5, 8, ... (shorter where a row is), left-padded
    as the serving engine pads them, then DECODE_STEPS greedy tokens: torch's pick is fed to both, each
    through its own cache; the largest logit difference over every pass and how often both picked the same
    token (the prompt's pass included)."""
    batch = data.collate(list(range(min(DECODE_PROMPTS, len(data)))))
    ids = batch["input_ids"]
    real = batch.get("attention_mask", torch.ones_like(ids)).sum(1)
    lengths = [max(1, min(int(real[i]), 2 + 3 * i)) for i in range(len(ids))]
    width = max(lengths)
    prompt = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(prompt)
    for i, n in enumerate(lengths):
        prompt[i, width - n :], mask[i, width - n :] = ids[i, :n], 1
    worst, same = decode_gap(model, onnx_module, prompt, mask, DECODE_STEPS)
    return {
        "prompts": len(lengths),
        "lengths": sorted(set(lengths)),
        "steps": DECODE_STEPS,
        "max_abs_diff": worst,
        "same_token": same / ((DECODE_STEPS + 1) * len(lengths)),
    }


def _full(built, task: str, batch) -> torch.Tensor:
    return tasks.forward(built, task, batch).float()


def _latencies(sides: dict[str, Any], task: str, data, max_seconds: float) -> dict[str, Any]:
    """Each side's forward pass over the first 1 and BATCH held-out rows (repeated when fewer), then torch
    at batch 1 again: how far the machine moved in between widens every spread."""
    timings: dict[str, dict[str, Timing]] = {}
    for n in (1, BATCH):
        batch = data.collate([i % len(data) for i in range(n)])
        timings[f"batch_{n}"] = {
            side: _timed(built, task, batch, max_seconds) for side, built in sides.items()
        }
    again = _timed(sides["torch"], task, data.collate([0]), max_seconds)
    drift = spread_between(timings["batch_1"]["torch"], again)
    return {
        "latency_ms": {b: {side: 1000 * t.median_s for side, t in by.items()} for b, by in timings.items()},
        "latency_spread": {
            b: {side: max(t.spread, drift) for side, t in by.items()} for b, by in timings.items()
        },
        "latency_waited": {b: {side: t.waited for side, t in by.items()} for b, by in timings.items()},
        "latency_drift": drift,
    }


def _timed(built, task: str, batch, max_seconds: float) -> Timing:
    with torch.inference_mode():
        return time_until_steady(lambda: tasks.forward(built, task, batch), max_seconds=max_seconds)


def latency_rows(report: dict) -> list[tuple[str, str, str]]:
    """The export table's latency rows (label, torch, onnxruntime): each batch's time with its spread, or
    'unreliable (spread ±N %)', and for a batch over 1 a row per sample beside it (a batch of 32 takes
    longer than a batch of 1, but less a sample: read apart, the figures look inverted)."""
    spreads, waits = report.get("latency_spread", {}), report.get("latency_waited", {})
    rows = []
    for batch, times in report.get("latency_ms", {}).items():
        n = int(batch.removeprefix("batch_"))
        trust = {s: said(spreads.get(batch, {}).get(s, 0.0), waits.get(batch, {}).get(s)) for s in times}
        rows.append((f"latency, batch of {n}", *(f"{times[s]:.3g} ms {trust[s]}" for s in ("torch", "onnx"))))
        if n > 1:
            rows.append((f"per sample, batch of {n}", *(f"{times[s] / n:.3g} ms" for s in ("torch", "onnx"))))
    return rows


def _state_bytes(module: torch.nn.Module) -> int:
    """Bytes of the model's tensors, a tensor shared by two names (tied embeddings) once."""
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in module.state_dict().values()}
    return sum(unique.values())


def graph_bytes(export_dir: Path) -> int:
    """Bytes of the graph and its weights (model.onnx, and model.onnx.data for a big one)."""
    return sum(f.stat().st_size for f in export_dir.glob(f"{GRAPH}*") if f.is_file())


def _checks(report: dict) -> dict[str, Any]:
    """Each floor this export should meet, with whether it did (None: not measured)."""
    metric = report.get("metric")
    if report["quantize"] is None:
        diff = report.get("max_abs_diff")
        checks = {f"max_abs_diff <= {FP32_TOLERANCE:g}": None if diff is None else diff <= FP32_TOLERANCE}
        if "decode" in report:  # generation through the cache, step by step
            checks[f"decode max_abs_diff <= {FP32_TOLERANCE:g}"] = (
                report["decode"]["max_abs_diff"] <= FP32_TOLERANCE
            )
        return checks
    if metric is None:
        close = None
    elif metric["name"] == "accuracy":
        close = abs(metric["delta"]) * 100 <= INT8_METRIC_POINTS
    else:
        close = metric["onnx"] <= metric["torch"] * (1 + INT8_METRIC_POINTS / 100)
    return {
        f"metric within {INT8_METRIC_POINTS:g} point": close,
        f"bytes <= {INT8_BYTES_RATIO:g} x torch": report["bytes"]["ratio"] <= INT8_BYTES_RATIO,
    }
