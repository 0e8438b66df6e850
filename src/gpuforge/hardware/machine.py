"""This machine, measured: every device torch sees, the all-reduce between local processes, and the OpenCL
devices; cached per machine (`gpuforge hw --refresh` measures again).

Figures carry their units in their names (`memory_bandwidth_gbs`, `matmul_tflops`). Each device also keeps
what the plan's roofline needs (`roofline`): matmul speed by size, bandwidth by element type, the cost of
one operation, and how close a real training step of ours comes to the roofline (`step_efficiency`).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpuforge.hardware import measure
from gpuforge.hardware.bench import DTYPES, cache_dir, forget_peaks, peak_flops, read_cache, write_cache
from gpuforge.hardware.probe import device_name
from gpuforge.hardware.roofline import (
    CONVERSION,
    OpTrace,
    Roof,
    bandwidth_by_size,
    matmul_efficiency,
)

CACHE_FILE = "hardware.json"
FORMAT = 4  # bump when the figures change meaning: an old cache is then measured again
WIDTHS = {"fp32": 4, "bf16": 2, "convert": CONVERSION}


@dataclass
class DeviceFigures:
    name: str
    type: str  # cpu | cuda | mps | xpu
    cores: int  # CPU cores torch uses, or a GPU's streaming multiprocessors
    memory_bytes: int
    memory_bandwidth_gbs: float  # STREAM triad
    stream_gbs: dict[str, float]  # copy, triad
    matmul_tflops: dict[str, float]  # per precision; int8 in TOPS
    host_device_gbs: dict[str, float] = field(default_factory=dict)  # GPUs: pinned and pageable, each way
    roofline: dict[str, Any] = field(default_factory=dict)
    datasheet: dict[str, Any] | None = None  # filled when shown: the catalog's figures beside ours

    def roof(self, precision: str) -> Roof:
        """The roofline of this device for a job in `precision`, from what was measured here."""
        r = self.roofline
        if precision not in r["matmul_curve_tflops"]:  # emulated here (fp16 on a CPU): the nearest we have
            precision = "bf16" if "bf16" in r["matmul_curve_tflops"] else "fp32"
        peak = self.matmul_tflops[precision]
        curve = {int(n): tf for n, tf in r["matmul_curve_tflops"][precision].items()}
        widths = {WIDTHS[k]: {1: gbs} for k, gbs in r["bandwidth_gbs"].items()}
        return Roof(
            name=self.name,
            peak_tflops=peak,
            efficiency=matmul_efficiency(curve, peak),
            bandwidth=bandwidth_by_size(widths),
            op_overhead_s=r["op_overhead_s"],
            special_gelems=r["special_gelems"],
            step_efficiency=r["step_efficiency"][precision],
        )


@dataclass
class Machine:
    host: str
    torch: str
    measured_at: str
    devices: list[DeviceFigures]
    allreduce: dict[str, Any]
    opencl: dict[str, Any]
    format: int = FORMAT

    def device(self, kind: str) -> DeviceFigures:
        for d in self.devices:
            if d.type == kind:
                return d
        raise KeyError(kind)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine(refresh: bool = False, opencl: bool = True) -> Machine:
    """This machine's figures: from the cache, or measured (a few seconds a device) and cached."""
    path = cache_dir() / CACHE_FILE
    key = _machine_key()
    cached = {} if refresh else read_cache(path)
    found = _from_dict(cached.get(key))
    if found is not None:
        return found
    if refresh:
        forget_peaks()  # the MFU peaks are this measurement's matmul figures: measured again with it
    found = measure_machine(opencl=opencl)
    write_cache(path, {**read_cache(path), key: found.as_dict()})
    return found


def measure_machine(opencl: bool = True) -> Machine:
    devices = [measure_device(torch.device("cpu"))]
    for i in range(torch.cuda.device_count()):
        devices.append(measure_device(torch.device("cuda", i)))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append(measure_device(torch.device("mps")))
    if hasattr(torch, "xpu") and torch.xpu.is_available():  # Intel GPUs
        devices += [measure_device(torch.device("xpu", i)) for i in range(torch.xpu.device_count())]
    kind = "cuda" if torch.cuda.device_count() > 1 else "cpu"
    return Machine(
        host=platform.node(),
        torch=torch.__version__,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        devices=devices,
        allreduce=measure.allreduce_bandwidth(kind),
        opencl=_opencl() if opencl else {"devices": [], "note": "not measured"},
    )


def measure_device(device: torch.device) -> DeviceFigures:
    stream = measure.stream_bandwidth(device)
    matmul = {p: peak_flops(device, p) / 1e12 for p in ("fp32", "bf16", "fp16") if not _emulated(device, p)}
    matmul.update({k: v for k, v in measure.matmul_peaks(device, only=("tf32", "int8")).items()})
    precisions = [p for p in ("fp32", "bf16", "fp16") if p in matmul]
    roofline = {
        "op_overhead_s": measure.op_overhead_s(device),
        "bandwidth_gbs": {
            kind: max(
                measure.elementwise_curve(device, kind, sizes=(measure.ELEMENTWISE_SIZES[-1],)).values()
            )
            for kind in WIDTHS
        },
        "matmul_curve_tflops": {p: measure.matmul_curve(device, p) for p in precisions},
        # a GPU's special units keep these memory-bound: only a CPU's bound the roofline
        "special_gelems": measure.special_gelems(device) if device.type == "cpu" else {},
    }
    figures = DeviceFigures(
        name=device_name(device),
        type=device.type,
        cores=_cores(device),
        memory_bytes=_memory(device),
        memory_bandwidth_gbs=stream["triad_gbs"],
        stream_gbs=stream,
        matmul_tflops=matmul,
        host_device_gbs=measure.host_device_bandwidth(device),
        roofline=roofline,
    )
    roofline["step_efficiency"] = {}
    for p in precisions:
        roofline["step_efficiency"][p] = step_efficiency(device, p, figures)
    return figures


def step_efficiency(
    device: torch.device, precision: str, figures: DeviceFigures, runs: int = 8, seconds: float = 1.5
) -> float:
    """The roofline's time for our reference training step over its measured median: what a real step
    reaches of the ideal on this device (Python, autograd, the kernels' own inefficiencies)."""
    step = measure.reference_step(device, precision)
    step()  # warm-up: the optimizer's state, the kernels' first use
    trace = OpTrace.of(step)
    figures.roofline.setdefault("step_efficiency", {})[precision] = 1.0  # the roof before we know it
    ideal = trace.ideal_seconds(figures.roof(precision))
    times: list[float] = []
    while len(times) < runs or sum(times) < seconds:  # a median over 1.5 s at least: one stall cannot move it
        start = time.perf_counter()
        step()
        measure.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(1.0, ideal / statistics.median(times))


def _emulated(device: torch.device, precision: str) -> bool:
    return precision != "fp32" and measure.too_slow(device, DTYPES[precision])


def _cores(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "cpu":
        return torch.get_num_threads()
    return 0


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "xpu":
        return torch.xpu.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _opencl() -> dict[str, Any]:
    from gpuforge.hardware.opencl import opencl_devices

    found, note = opencl_devices()
    return {"devices": [asdict(d) for d in found], "note": note}


def _machine_key() -> str:
    """Figures belong to this machine, this torch and this many threads: any change measures again."""
    from gpuforge.hardware.probe import cpu_model_name

    gpus = ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    threads = torch.get_num_threads()
    return f"{platform.node()}|{cpu_model_name()}|{threads} threads|torch {torch.__version__}|{gpus}"


def _from_dict(raw: Any) -> Machine | None:
    """A cached machine, or None for one of another format or damaged: it is measured again."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None
    try:
        found = Machine(**{**raw, "devices": [DeviceFigures(**d) for d in raw["devices"]]})
        for d in found.devices:  # every figure the roofline reads, there
            for p in d.roofline["matmul_curve_tflops"]:
                d.roof(p)
        return found
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
