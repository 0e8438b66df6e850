"""What each compressed variant costs and gives: sizes, latency at batch 1 and 32, the task metric.

report.json (contract):
  {"variants": [{"name", "params", "nonzero_params", "disk_bytes", "memory_bytes", "latency_ms_b1",
                 "latency_ms_b32", "latency_spread_b1", "latency_spread_b32", "latency_waited_b1",
                 "latency_waited_b32", "latency_reliable_b1", "latency_reliable_b32",
                 "metric": {"name", "value"}, ...}, ...]}  the original first,
  which also has "latency_drift_b1", "latency_drift_b32" once it is timed again after the variants
Latency at each batch size is timed as hardware/timing.py times everything: runs repeated until their
spread is small or a time cap is reached; the figure is their median, the spread says whether to trust it.
A shared machine also speeds up and slows down between variants: the original, timed again after them,
shows by how much (its drift), and every spread is widened to at least that. A spread over NOISY, or
threads that waited for a CPU over BUSY of the time, make a figure unreliable, and the table says so.
Deltas are against the original; `pareto` marks the variants no other variant beats: as small in memory,
as good on the metric, not slower at either batch size, and better on one of these, where latency counts
only between reliable figures that differ beyond both spreads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from torch import nn

from gpuforge.hardware.timing import (
    BUSY,
    NOISY,
    Timing,
    is_reliable,
    spread_between,
    time_until_steady,
    unreliable,
)
from gpuforge.models.base import BuiltModel
from gpuforge.runtime import tasks
from gpuforge.runtime.evaluate import evaluate
from gpuforge.runtime.precision import Precision
from gpuforge.weights.quantize import tensor_bytes

BATCHES = (1, 32)
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


def latency(built: BuiltModel, task: str, batch: dict[str, torch.Tensor]) -> Timing:
    """One forward pass over `batch`, timed until its spread is small or the time cap (timing.py's)."""
    with torch.inference_mode():
        return time_until_steady(lambda: tasks.forward(built, task, batch))


def latencies(built: BuiltModel, task: str, eval_data) -> dict[int, Timing]:
    """The forward pass at each of BATCHES, held-out rows repeated to fill a batch."""
    return {n: latency(built, task, batch_of(eval_data, n)) for n in BATCHES}


def latency_fields(timings: dict[int, Timing]) -> dict[str, Any]:
    """A row's latency figures: each batch size's median in ms, its spread, the share of the time its
    threads waited for a CPU (None: not known here), and whether to trust it."""
    fields: dict[str, Any] = {}
    for n, timing in timings.items():
        fields[f"latency_ms_b{n}"] = 1000 * timing.median_s
        fields[f"latency_spread_b{n}"] = timing.spread
        fields[f"latency_waited_b{n}"] = timing.waited
        fields[f"latency_reliable_b{n}"] = timing.reliable
    return fields


def add_drift(variants: list[dict[str, Any]], first: dict[int, Timing], again: dict[int, Timing]) -> None:
    """The original (variants[0]), timed `first` before the variants and `again` after them: how far the
    machine's speed moved meanwhile (the same spread, each timing a window), in place. Any variant timed
    in between may be off by as much, so every spread is widened to at least that."""
    for n in first:
        drift = spread_between(first[n], again[n])
        variants[0][f"latency_drift_b{n}"] = drift
        for v in variants:
            v[f"latency_spread_b{n}"] = max(v[f"latency_spread_b{n}"], drift)
            v[f"latency_reliable_b{n}"] = _reliable(v, n)


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
    timings: dict[int, Timing] | None = None,
) -> dict[str, Any]:
    """One variant's row of report.json (the model in eval mode on the CPU); `timings`: its latencies,
    where the caller timed them already."""
    built.module.eval()
    metric = evaluate(built, task, eval_data, 32, FP32, torch.device("cpu"))
    metric_name = "accuracy" if "accuracy" in metric else "perplexity"
    timings = timings or latencies(built, task, eval_data)
    return {
        "name": name,
        "params": counts[0],
        "nonzero_params": counts[1],
        "disk_bytes": disk_bytes,
        "memory_bytes": tensor_bytes(built.module),
        **latency_fields(timings),
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
        v_faster = any(clearly_faster(v, o, n) for n in BATCHES)
        as_good = o["memory_bytes"] <= v["memory_bytes"] and om >= vm and not v_faster
        o_faster = any(clearly_faster(o, v, n) for n in BATCHES)
        return as_good and (o["memory_bytes"] < v["memory_bytes"] or om > vm or o_faster)

    for v in variants:
        v["pareto"] = not any(beats(o, v) for o in variants if o is not v)


def _reliable(v: dict[str, Any], batch: int) -> bool:
    """Older reports have no spread or wait: reliable as far as they say."""
    return is_reliable(v.get(f"latency_spread_b{batch}", 0), v.get(f"latency_waited_b{batch}"))


def clearly_faster(a: dict[str, Any], b: dict[str, Any], batch: int) -> bool:
    """a's latency at `batch` is below b's by more than both their spreads, and both figures are reliable:
    a difference inside a spread, or on a machine too busy to time, is the machine's, not the variant's."""
    ms, spread = f"latency_ms_b{batch}", f"latency_spread_b{batch}"
    if ms not in a or ms not in b or not (_reliable(a, batch) and _reliable(b, batch)):
        return False
    return a[ms] * (1 + a.get(spread, 0)) < b[ms] * (1 - b.get(spread, 0))


def _ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def size_text(n: float) -> str:
    """Bytes in the unit that keeps three figures: a small model's 40.2 KB, not 0.0 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _latency_cell(v: dict[str, Any], batch: int) -> str:
    """The figure and its spread, or '?' after an unreliable one (the caption says why)."""
    figure = _ms(v[f"latency_ms_b{batch}"])
    return f"{figure} ±{v.get(f'latency_spread_b{batch}', 0):.0%}" if _reliable(v, batch) else f"{figure} ?"


def unreliable_figures(variants: list[dict[str, Any]]) -> dict[str, str]:
    """The latency figures not to be trusted ('variant bN') and why ('unreliable (spread ±N %)')."""
    return {
        f"{v['name']} b{n}": unreliable(v.get(f"latency_spread_b{n}", 0), v.get(f"latency_waited_b{n}"))
        for v in variants
        for n in BATCHES
        if not _reliable(v, n)
    }


def _caption(variants: list[dict[str, Any]]) -> str:
    """What the star means, and which figures are not to be trusted and why."""
    lines = [
        "*: no other variant is as small, as good and as fast, and better on one; latency counts only "
        "where both figures are reliable and differ beyond both spreads"
    ]
    drift = max(variants[0].get(f"latency_drift_b{n}", 0) for n in BATCHES)
    if drift > NOISY:
        lines.append(
            f"the original, timed first and again last, moved ±{drift:.0%}: the machine's load changed, "
            "every spread is at least that"
        )
    doubtful = unreliable_figures(variants)
    if doubtful:
        listed = list(doubtful.items())[:4]
        more = f" and {len(doubtful) - len(listed)} more" if len(doubtful) > len(listed) else ""
        lines.append(
            f"?: {len(doubtful)} of {len(BATCHES) * len(variants)} latency figures are unreliable (spread "
            f"over ±{NOISY:.0%}, or threads waiting for a CPU over {BUSY:.0%} of the time): "
            + ", ".join(f"{name} {why}" for name, why in listed)
            + f"{more}; they decide nothing (a busy machine? measure again when it is quieter)"
        )
    return "\n".join(lines)


def table(variants: list[dict[str, Any]]) -> Group:
    """The terminal table, narrow enough for 80 columns: one row a variant, the share of non-zero
    parameters, sizes in the unit that keeps three figures, latency with its spread (the caption says
    which figures are unreliable), the metric and its change (parameter counts and ratios to the original
    are in report.json)."""
    original = variants[0]
    metric_name = original["metric"]["name"]
    title = "compressed variants (*: Pareto front; change: against the original)"
    if original.get("adapter"):
        title += "; the original is a LoRA adapter on its base"
    out = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0))  # 0: the box's own space between columns
    out.add_column("variant", overflow="fold", min_width=14)  # a long name wraps, never cut
    for column in ("nonzero", "disk", "mem", "b1 ms", "b32 ms", metric_name, "change"):
        out.add_column(column, justify="right", no_wrap=True)
    out.add_column("*", no_wrap=True)
    for v in variants:
        out.add_row(
            v["name"],
            f"{v['nonzero_params'] / v['params']:.0%}",
            size_text(v["disk_bytes"]),
            size_text(v["memory_bytes"]),
            _latency_cell(v, 1),
            _latency_cell(v, 32),
            f"{v['metric']['value']:.4f}",
            f"{v.get('delta', {}).get('metric', 0):+.3f}",
            "*" if v.get("pareto") else "",
        )
    # the caption below the table, indented like its rows: every line of it reads as the table's own
    return Group(out, Padding(Text(_caption(variants)), (0, 0, 0, 1)))
