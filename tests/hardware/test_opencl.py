import dataclasses
import os
import sys

import pytest

from gpuforge.hardware.opencl import OpenCLDevice, opencl_devices

# Set by CI jobs that install the opencl extra: there a missing runtime is a failure, not a skip.
REQUIRED = os.environ.get("GPUFORGE_REQUIRE_OPENCL") == "1"


def _skip_or_fail(why: str):
    if REQUIRED:
        pytest.fail(f"GPUFORGE_REQUIRE_OPENCL=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cpu_device() -> OpenCLDevice:
    try:
        import pyopencl  # noqa: F401
    except ImportError:
        _skip_or_fail("pyopencl is not installed (the opencl extra)")
    devices, why = opencl_devices(seconds=0.2)
    cpus = [d for d in devices if d.type == "cpu"]
    if not cpus:
        _skip_or_fail(f"no OpenCL CPU device (PoCL): {why or [d.name for d in devices]}")
    return cpus[0]


def test_pocl_lists_the_cpu_with_a_measured_bandwidth(cpu_device):
    assert cpu_device.error is None
    assert cpu_device.compute_units >= 1
    assert cpu_device.memory_bandwidth_gbs is not None and cpu_device.memory_bandwidth_gbs > 0.1
    assert cpu_device.global_memory_bytes > 0 and cpu_device.version.startswith("OpenCL")


def test_every_field_has_its_type(cpu_device):
    ints = {"compute_units", "clock_mhz", "global_memory_bytes"}
    for field in dataclasses.fields(OpenCLDevice):
        value = getattr(cpu_device, field.name)
        if field.name in ints:
            assert type(value) is int, field.name
        elif field.name == "memory_bandwidth_gbs":
            assert type(value) is float
        elif field.name == "error":
            assert value is None
        else:
            assert isinstance(value, str) and value, field.name
    assert cpu_device.type in {"cpu", "gpu", "accelerator", "other"}


def test_listing_without_measuring_runs_no_kernel(cpu_device):
    devices, why = opencl_devices(measure=False)
    assert why is None and devices
    assert all(d.memory_bandwidth_gbs is None and d.error is None for d in devices)


def test_without_pyopencl_the_reason_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # makes `import pyopencl` fail as if absent
    devices, why = opencl_devices()
    assert devices == []
    assert why.startswith("no OpenCL: pyopencl is not installed") and "gpuforge[opencl]" in why
