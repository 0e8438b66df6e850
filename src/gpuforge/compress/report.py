"""What each compressed variant costs and gives: sizes, latency at batch 1 and 32, the task metric.

report.json (contract):
  {"variants": [{"name", "params", "nonzero_params", "disk_bytes", "memory_bytes", "latency_ms_b1",
                 "latency_ms_b32", "latency_spread_b1", "latency_spread_b32", "metric": {"name", "value"},
                 ...}, ...]}  the original first
Latency is timed in LATENCY_REPEATS repeats: the figure is the median of the repeats' medians, the spread
half the range between the fastest and slowest repeat, relative to the figure (0.05: +-5%). A shared
machine moves latency by more than a variant's gain at times, so latency only counts as better beyond
both spreads. Deltas are against the original; `pareto` marks the variants no other variant beats: as
good on memory, batch-32 latency and the metric, and better on one of them.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.table import Table
from torch import nn

from gpuforge.models.base import BuiltModel
from gpuforge.runtime import tasks
from gpuforge.runtime.evaluate import evaluate
from gpuforge.runtime.precision import Precision
from gpuforge.weights.quantize import tensor_bytes

LATENCY_REPEATS = 5
LATENCY_REPEAT_SECONDS = 0.1  # each repeat runs at least once and until this much time has passed
FP32 = Precision("fp32", "compressed models are measured with fp32 activations")


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(parameters, non-zero parameters) of the float model, before any quantization."""
    total = nonzero = 0
    for p in module.parameters():
        total += p.numel()
        nonzero += int(torch.count_nonzero(p.detach())) if p.is_floating_point() else p.numel()
    return total, nonzero


def latency_ms(built: BuiltModel, task: str, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(median wall time of one forward pass in ms, its relative spread), over LATENCY_REPEATS repeats
    after two warm-ups: the median of the repeats' medians, and half their range over that."""
    medians: list[float] = []
    with torch.inference_mode():
        for _ in range(2):
            tasks.forward(built, task, batch)
        for _ in range(LATENCY_REPEATS):
            times: list[float] = []
            while not times or sum(times) < LATENCY_REPEAT_SECONDS:
                start = time.perf_counter()
                tasks.forward(built, task, batch)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
    median = statistics.median(medians)
    return 1000 * median, (max(medians) - min(medians)) / 2 / median


def batch_of(data, size: int) -> dict[str, torch.Tensor]:
    indices = [i % len(data) for i in range(size)]  # a small eval set is repeated to fill the batch
    return data.collate(indices)


def measure(
    name: str,
    built: BuiltModel,
    task: str,
    eval_data,
    counts: tuple[int, int],
    disk_bytes: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One variant's row of report.json (the model in eval mode on the CPU)."""
    built.module.eval()
    metric = evaluate(built, task, eval_data, 32, FP32, torch.device("cpu"))
    metric_name = "accuracy" if "accuracy" in metric else "perplexity"
    b1, spread_b1 = latency_ms(built, task, batch_of(eval_data, 1))
    b32, spread_b32 = latency_ms(built, task, batch_of(eval_data, 32))
    return {
        "name": name,
        "params": counts[0],
        "nonzero_params": counts[1],
        "disk_bytes": disk_bytes,
        "memory_bytes": tensor_bytes(built.module),
        "latency_ms_b1": b1,
        "latency_ms_b32": b32,
        "latency_spread_b1": spread_b1,
        "latency_spread_b32": spread_b32,
        "metric": {"name": metric_name, "value": metric[metric_name]},
        **(extra or {}),
    }


def add_deltas_and_front(variants: list[dict[str, Any]]) -> None:
    """Deltas against the first (original) variant, and the Pareto front, in place."""
    original = variants[0]
    higher_is_better = original["metric"]["name"] == "accuracy"
    for v in variants:
        v["delta"] = {
            "memory": v["memory_bytes"] / original["memory_bytes"],
            "disk": v["disk_bytes"] / original["disk_bytes"] if original["disk_bytes"] else None,
            "latency_b32": v["latency_ms_b32"] / original["latency_ms_b32"],
            "metric": v["metric"]["value"] - original["metric"]["value"],
        }

    def beats(o: dict[str, Any], v: dict[str, Any]) -> bool:  # as good as v on every axis, better on one
        om, vm = o["metric"]["value"], v["metric"]["value"]
        if not higher_is_better:
            om, vm = -om, -vm
        as_good = o["memory_bytes"] <= v["memory_bytes"] and om >= vm and not _clearly_faster(v, o)
        return as_good and (o["memory_bytes"] < v["memory_bytes"] or om > vm or _clearly_faster(o, v))

    for v in variants:
        v["pareto"] = not any(beats(o, v) for o in variants if o is not v)


def _clearly_faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """a's batch-32 latency is below b's beyond both their spreads (older reports have none: 0)."""
    a_high = a["latency_ms_b32"] * (1 + a.get("latency_spread_b32", 0))
    b_low = b["latency_ms_b32"] * (1 - b.get("latency_spread_b32", 0))
    return a_high < b_low


def _ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table(variants: list[dict[str, Any]]) -> Table:
    """The terminal table, narrow enough for 80 columns: one row a variant, sizes in MB, latency with
    its spread, the ratio of batch-32 latency to the original's, the metric and its change (parameter
    counts are in report.json)."""
    original = variants[0]
    metric_name = original["metric"]["name"]
    title = "compressed variants (x: ratio to the original; *: on the Pareto front)"
    if original.get("adapter"):
        title += "; the original is a LoRA adapter on its base"
    out = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0))  # one space between columns
    out.add_column("variant", overflow="fold", min_width=14)  # a long name wraps, never cut
    for column in ("nonzero", "disk MB", "mem MB", "b1 ms", "b32 ms", "x b32", metric_name, "change"):
        out.add_column(column, justify="right", no_wrap=True)
    out.add_column("*", no_wrap=True)
    for v in variants:
        d = v.get("delta", {})
        out.add_row(
            v["name"],
            f"{v['nonzero_params'] / v['params']:.0%}",
            f"{v['disk_bytes'] / 1e6:.1f}",
            f"{v['memory_bytes'] / 1e6:.1f}",
            _ms(v["latency_ms_b1"]),
            f"{_ms(v['latency_ms_b32'])} ±{v.get('latency_spread_b32', 0):.0%}",
            f"{d.get('latency_b32', 1):.2f}",
            f"{v['metric']['value']:.4f}",
            f"{d.get('metric', 0):+.3f}",
            "*" if v.get("pareto") else "",
        )
    return out
