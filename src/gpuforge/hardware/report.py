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
    t = Table(
        title="this machine, measured (datasheet figure and measured/datasheet where the model is known)"
    )
    for col in ("device", "cores", "memory", "memory bandwidth", *PRECISIONS, "host<->device"):
        t.add_column(col)
    for d in found["devices"]:
        sheet = d["datasheet"] or {}
        ratio = sheet.get("ratio", {})
        bandwidth = f"{d['memory_bandwidth_gbs']:.1f} GB/s"
        if sheet:
            bandwidth += f" / {sheet['memory_bandwidth_gbs']:g} ({ratio['memory_bandwidth']:.0%})"
        cells = []
        for p in PRECISIONS:
            measured = d["matmul_tflops"].get(p)
            cell = "-" if measured is None else _tflops(measured)
            if measured is not None and f"matmul_{p}" in ratio:
                cell += f" / {sheet['matmul_tflops'][p]:g} ({ratio[f'matmul_{p}']:.0%})"
            cells.append(cell)
        copies = d["host_device_gbs"]
        host = (
            f"pinned {copies['h2d_pinned_gbs']:.1f}/{copies['d2h_pinned_gbs']:.1f}, "
            f"pageable {copies['h2d_pageable_gbs']:.1f}/{copies['d2h_pageable_gbs']:.1f} GB/s"
            if copies
            else "-"
        )
        unit = "SMs" if d["type"] == "cuda" else "threads"
        t.add_row(
            f"{d['name']} ({d['type']})",
            f"{d['cores']} {unit}",
            f"{d['memory_bytes'] / 2**30:.1f} GiB",
            bandwidth,
            *cells,
            host,
        )
    return t


def _tflops(value: float) -> str:
    return f"{value:.3g} TFLOP/s" if value >= 1 else f"{value * 1000:.3g} GFLOP/s"


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
