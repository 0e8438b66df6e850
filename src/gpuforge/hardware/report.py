"""`gpuforge hw`: the article's table for this machine, measured, each figure beside its datasheet's."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gpuforge.hardware.catalog import datasheet_for, load_catalog
from gpuforge.hardware.machine import machine

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "int8")


def report(refresh: bool = False) -> dict[str, Any]:
    """This machine's figures (hardware/machine.py) with, per device, the catalog's where it knows the model:
    `datasheet` holds its figures and `ratio` measured over datasheet."""
    found = machine(refresh=refresh).as_dict()
    catalog = load_catalog()
    for device in found["devices"]:
        device["datasheet"] = _datasheet(device, catalog)
    return found


def _datasheet(device: dict[str, Any], catalog) -> dict[str, Any] | None:
    entry = datasheet_for(catalog, device["name"]) if device["type"] != "cpu" else None
    if entry is None:
        return None
    ratio = {"memory_bandwidth": device["memory_bandwidth_gbs"] / entry.memory_bandwidth_gbs}
    for precision, tflops in device["matmul_tflops"].items():
        if entry.tflops.get(precision):
            ratio[f"matmul_{precision}"] = tflops / entry.tflops[precision]
    return {
        "key": entry.key,
        "name": entry.name,
        "memory_bandwidth_gbs": entry.memory_bandwidth_gbs,
        "matmul_tflops": entry.tflops,
        "ratio": ratio,
    }


def tables(found: dict[str, Any]) -> list[Table | str]:
    out: list[Table | str] = [_devices(found)]
    reduce = found["allreduce"]
    if reduce.get("bus_gbs"):
        out.append(
            f"all-reduce ({reduce['backend']}, {reduce['processes']} local processes, "
            f"{reduce['size_bytes'] / 2**20:.0f} MiB): {reduce['bus_gbs']:.2f} GB/s bus bandwidth"
        )
    elif reduce.get("error"):
        out.append(f"all-reduce ({reduce['backend']}): could not be measured: {reduce['error']}")
    out.append(_opencl(found["opencl"]))
    out.append(
        f"measured {found['measured_at']} with torch {found['torch']}; `gpuforge hw --refresh` measures again"
    )
    return out


def _devices(found: dict[str, Any]) -> Table:
    """The article's table turned a quarter: a row per figure, a column per device."""
    t = Table(title="this machine, measured (beside: the datasheet's figure, and measured / datasheet)")
    t.add_column("figure", no_wrap=True)
    for d in found["devices"]:
        t.add_column(f"{d['name']} ({d['type']})")
    rows: dict[str, list[str]] = {}
    for d in found["devices"]:
        sheet = d["datasheet"] or {}
        ratio = sheet.get("ratio", {})
        unit = "SMs" if d["type"] == "cuda" else "threads"
        cells = {
            "cores": f"{d['cores']} {unit}",
            "memory": f"{d['memory_bytes'] / 2**30:.1f} GiB",
            "memory bandwidth": f"{d['memory_bandwidth_gbs']:.1f} GB/s (STREAM triad)"
            + (f" / {sheet['memory_bandwidth_gbs']:g} ({ratio['memory_bandwidth']:.0%})" if sheet else ""),
        }
        for p in PRECISIONS:
            measured = d["matmul_tflops"].get(p)
            cell = "-" if measured is None else _tflops(measured, "OP/s" if p == "int8" else "FLOP/s")
            if measured is not None and f"matmul_{p}" in ratio:
                cell += f" / {sheet['matmul_tflops'][p]:g} ({ratio[f'matmul_{p}']:.0%})"
            cells[f"matmul {p}"] = cell
        copies = d["host_device_gbs"]
        for way, label in (("h2d", "host -> device"), ("d2h", "device -> host")):
            cells[label] = (
                f"{copies[f'{way}_pinned_gbs']:.1f} GB/s pinned, {copies[f'{way}_pageable_gbs']:.1f} pageable"
                if copies
                else "-"
            )
        for label, cell in cells.items():
            rows.setdefault(label, []).append(cell)
    for label, cells in rows.items():
        t.add_row(label, *cells)
    return t


def _tflops(value: float, unit: str) -> str:
    return f"{value:.3g} T{unit}" if value >= 1 else f"{value * 1000:.3g} G{unit}"


def _opencl(section: dict[str, Any]) -> Table | str:
    if not section["devices"]:
        return section["note"] or "no OpenCL device"
    t = Table(title="OpenCL devices (bandwidth: a triad kernel of ours)")
    for col in ("platform", "device", "type", "compute units", "memory", "bandwidth"):
        t.add_column(col)
    for d in section["devices"]:
        gbs = d["memory_bandwidth_gbs"]
        t.add_row(
            d["platform"],
            d["name"],
            d["type"],
            str(d["compute_units"]),
            f"{d['global_memory_bytes'] / 2**30:.1f} GiB",
            f"{gbs:.1f} GB/s" if gbs is not None else f"not measured: {d['error']}",
        )
    return t
