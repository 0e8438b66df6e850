"""`gpuforge hw`: this machine measured like the article's table, figures named with their units, cached."""

import json
import re
import time

import pytest

from gpuforge.hardware.bench import read_cache
from gpuforge.hardware.catalog import load_catalog
from gpuforge.hardware.report import _datasheet
from tests.helpers.cli import run_cli


@pytest.fixture(scope="module")
def figures():
    first = run_cli("hw", "--json", timeout=300)  # measures where the session's cache has no figures yet
    assert first.returncode == 0, first.stderr
    return json.loads(first.stdout)


@pytest.mark.slow
def test_hw_json_names_each_measured_figure_with_its_unit(figures):
    (cpu,) = [d for d in figures["devices"] if d["type"] == "cpu"]
    assert cpu["cores"] >= 1 and cpu["memory_bytes"] > 2**30
    assert 0.1 < cpu["memory_bandwidth_gbs"] < 10_000 and set(cpu["stream_gbs"]) == {"copy_gbs", "triad_gbs"}
    assert cpu["matmul_tflops"]["fp32"] > 1e-3
    assert cpu["host_device_gbs"] == {} and cpu["datasheet"] is None  # no datasheet for an unknown CPU
    roofline = cpu["roofline"]
    assert 0 < roofline["op_overhead_s"] < 1e-3
    assert 0 < roofline["step_efficiency"]["fp32"] <= 1
    assert figures["allreduce"]["backend"] == "gloo" and figures["allreduce"]["bus_gbs"] > 0
    opencl = figures["opencl"]
    assert opencl["devices"] or opencl["note"]  # a device list, or one line saying why there is none


@pytest.mark.slow
def test_hw_is_cached_and_its_table_shows_the_articles_columns(figures):
    start = time.perf_counter()
    again = run_cli("hw")
    assert again.returncode == 0, again.stderr
    assert time.perf_counter() - start < 30  # read, not measured (a measurement takes ~15 s here)
    for row in ("memory bandwidth", "matmul fp32", "matmul bf16", "matmul int8", "host -> device"):
        assert row in again.stdout
    assert "all-reduce (gloo, 2 local processes" in again.stdout
    assert f"measured {figures['measured_at']}" in again.stdout  # the same measurement, from the cache
    said = re.search(r"a job runs on .*; precision auto picks (fp32|bf16|fp16): (.*)", again.stdout)
    assert said and "auto:" not in said.group(2), again.stdout  # the choice and its reason, "auto" once


def test_a_known_gpu_is_shown_beside_its_datasheet():
    measured = {
        "name": "NVIDIA H100 80GB HBM3",
        "type": "cuda",
        "memory_bandwidth_gbs": 2680.0,
        "matmul_tflops": {"bf16": 692.65, "int8": 1000.0},
    }
    sheet = _datasheet(measured, load_catalog())
    assert sheet["key"] == "h100-sxm"
    assert sheet["ratio"]["memory_bandwidth"] == pytest.approx(2680 / 3350)
    assert sheet["ratio"]["matmul_bf16"] == pytest.approx(692.65 / 989.5)


@pytest.mark.parametrize("damage", ["[1, 2]", '"text"', '{"KEY": "not a machine"}', '{"KEY": {"format": 4}}'])
def test_a_damaged_cache_is_measured_again_not_a_crash(tmp_path, monkeypatch, damage):
    from gpuforge.hardware import machine as machine_module

    monkeypatch.setenv("GPUFORGE_CACHE_DIR", str(tmp_path))
    (tmp_path / machine_module.CACHE_FILE).write_text(damage.replace("KEY", machine_module._machine_key()))
    cached = read_cache(tmp_path / machine_module.CACHE_FILE)
    assert machine_module._from_dict(cached.get(machine_module._machine_key())) is None
