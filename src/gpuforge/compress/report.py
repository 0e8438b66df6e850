"""What each compressed variant costs and gives: sizes, latency at batch 1 and 32, the task metric.

report.json (contract):
  {"variants": [{"name", "params", "nonzero_params", "disk_bytes", "memory_bytes", "latency_ms_b1",
                 "latency_ms_b32", "metric": {"name", "value"}, ...}, ...]}  the original first
Deltas are against the original; `pareto` marks the variants no other variant beats on memory, batch-32
latency and the metric at once.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch import nn

from gpuforge.compress.quantize import tensor_bytes
from gpuforge.models.base import BuiltModel
from gpuforge.train import tasks
from gpuforge.train.engine import evaluate
from gpuforge.train.precision import Precision

LATENCY_MIN_RUNS = 5
LATENCY_MIN_SECONDS = 0.5
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


def latency_ms(built: BuiltModel, task: str, batch: dict[str, torch.Tensor]) -> float:
    """Median wall time of one forward pass (at least 5 runs and 0.5 s of them), after two warm-ups."""
    times: list[float] = []
    with torch.inference_mode():
        for _ in range(2):
            tasks.forward(built, task, batch)
        while len(times) < LATENCY_MIN_RUNS or sum(times) < LATENCY_MIN_SECONDS:
            start = time.perf_counter()
            tasks.forward(built, task, batch)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


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
    return {
        "name": name,
        "params": counts[0],
        "nonzero_params": counts[1],
        "disk_bytes": disk_bytes,
        "memory_bytes": tensor_bytes(built.module),
        "latency_ms_b1": latency_ms(built, task, batch_of(eval_data, 1)),
        "latency_ms_b32": latency_ms(built, task, batch_of(eval_data, 32)),
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

    def key(v):  # smaller is better on every axis
        m = v["metric"]["value"]
        return (v["memory_bytes"], v["latency_ms_b32"], -m if higher_is_better else m)

    for v in variants:
        mine = key(v)
        v["pareto"] = not any(
            all(a <= b for a, b in zip(key(o), mine, strict=True)) and key(o) != mine for o in variants
        )


def table(variants: list[dict[str, Any]]) -> Table:
    """The terminal table: one row a variant, ratios to the original beside the figures."""
    metric_name = variants[0]["metric"]["name"]
    out = Table(title="compressed variants (x: ratio to the original; *: on the Pareto front)")
    for column in ("variant", "params", "nonzero", "disk MB", "mem MB", "x mem", "b1 ms", "b32 ms", "x b32"):
        out.add_column(column, justify="left" if column == "variant" else "right")
    out.add_column(metric_name, justify="right")
    out.add_column("delta", justify="right")
    out.add_column("*")
    for v in variants:
        d = v.get("delta", {})
        out.add_row(
            v["name"],
            f"{v['params']:,}",
            f"{v['nonzero_params'] / v['params']:.0%}",
            f"{v['disk_bytes'] / 1e6:.2f}",
            f"{v['memory_bytes'] / 1e6:.2f}",
            f"{d.get('memory', 1):.2f}",
            f"{v['latency_ms_b1']:.2f}",
            f"{v['latency_ms_b32']:.2f}",
            f"{d.get('latency_b32', 1):.2f}",
            f"{v['metric']['value']:.4f}",
            f"{d.get('metric', 0):+.4f}",
            "*" if v.get("pareto") else "",
        )
    return out
