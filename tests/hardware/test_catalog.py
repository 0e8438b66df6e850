"""The device catalog: every shipped figure is plausible and sourced; names and aliases resolve; torch device
names find their datasheet and nothing else; $GPUFORGE_HOME/devices.yaml overrides, prices an owned machine,
adds devices, and its errors name the file, the entry and the field."""

from importlib import resources

import pytest
import yaml

from gpuforge.errors import SpecError
from gpuforge.hardware.catalog import (
    CATALOG_FILE,
    FIGURES,
    PRECISIONS,
    datasheet_for,
    load_catalog,
    resolve,
)
from gpuforge.prices import DevicePrice

REQUIRED = {"h200", "h100-sxm", "h100-pcie", "a100-40gb", "a100-80gb", "l40s", "l4", "a10g", "rtx-4090",
            "mi300x", "tpu-v5e"}  # fmt: skip


@pytest.fixture
def shipped(tmp_path):
    return load_catalog(home=tmp_path)  # an empty home: no overrides


def write(home, devices):
    (home / CATALOG_FILE).write_text(yaml.safe_dump({"devices": devices}))


def test_every_shipped_device_is_sourced_and_plausible(shipped):
    raw = yaml.safe_load((resources.files("gpuforge.hardware") / CATALOG_FILE).read_text())
    assert str(raw["date"]) == "2026-12-01" and REQUIRED <= set(shipped)
    for key, device in shipped.items():
        assert device.origin == "shipped (2026-12-01)"
        given = [f for f in FIGURES if raw["devices"][key].get(f) is not None]
        assert not [f for f in given if not device.sources.get(f)], key  # a source for every figure given
        assert set(device.tflops) <= set(PRECISIONS) and device.tflops.get("bf16"), key
        if "fp8" in device.tflops:
            assert device.tflops["bf16"] <= device.tflops["fp8"], key  # dense, both halved alike
        if "fp32" in device.tflops:
            assert device.tflops["fp32"] <= device.tflops["bf16"], key
        assert 8e9 <= device.memory_bytes <= 300e9, key
        assert 100 <= device.memory_bandwidth_gbs <= 10_000, key
        assert device.usd_per_hour is None or 0.1 <= device.usd_per_hour <= 20, key
        assert device.kind in ("cuda", "rocm", "tpu") and device.torch == (device.kind != "tpu"), key
    assert shipped["h100-sxm"].tflops["bf16"] == pytest.approx(989, abs=1)  # the datasheet's 1,979 halved
    assert shipped["h200"].memory_bytes == 141e9 and shipped["h200"].memory_bandwidth_gbs == 4800


def test_keys_and_aliases_resolve_and_an_unknown_name_lists_the_keys(shipped):
    assert resolve(shipped, "h100").key == "h100-sxm"
    assert resolve(shipped, " A100 ").key == "a100-80gb"
    assert resolve(shipped, "4090").key == "rtx-4090"
    assert resolve(shipped, "L4").key == "l4"
    with pytest.raises(SpecError, match=r"unknown device 'b300': the catalog knows a100-40gb, a100-80gb,"):
        resolve(shipped, "b300")


@pytest.mark.parametrize(
    "device_name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10G", "a10g"),
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI300X VF", "mi300x"),
        ("NVIDIA L40", None),  # not an L40S, nor an L4
        ("NVIDIA GH200 480GB", None),  # "H200" inside a word
        ("NVIDIA H200 NVL", None),  # another board: 600 W, lower clocks
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None),  # a slice is not the datasheet's device
        ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
        ("NVIDIA A100 80GB PCIe", None),
        ("Tesla T4", None),
    ],
)
def test_a_torch_device_name_finds_its_datasheet_and_only_its_own(shipped, device_name, key):
    found = datasheet_for(shipped, device_name)
    assert (found and found.key) == key


def test_overrides_reprice_a_device_price_an_owned_one_and_add_another(tmp_path):
    write(tmp_path, {
        "h100-sxm": {"usd_per_hour": 1.99},
        "a100-80gb": {"price": {"purchase_usd": 30_000, "years": 4, "watts": 700, "usd_per_kwh": 0.15,
                                "utilisation": 0.6}},
        "my-gpu": {"name": "My GPU", "kind": "cuda", "memory_gb": 32, "memory_bandwidth_gbs": 900,
                   "tflops": {"bf16": 200}, "aliases": ["mine"], "match": ["My GPU 32GB"]},
    })  # fmt: skip
    catalog = load_catalog(home=tmp_path)
    here = str(tmp_path / CATALOG_FILE)
    h100 = catalog["h100-sxm"]
    assert h100.usd_per_hour == 1.99 and h100.sources["usd_per_hour"] == here and h100.origin == here
    assert h100.tflops["bf16"] == pytest.approx(989.5) and "nvidia.com" in h100.sources["tflops"]  # kept
    owned = DevicePrice(purchase_usd=30_000, years=4, watts=700, usd_per_kwh=0.15, utilisation=0.6)
    assert catalog["a100-80gb"].usd_per_hour == pytest.approx(owned.hourly())  # ~$1.53/h
    mine = resolve(catalog, "mine")
    assert (mine.key, mine.torch, mine.memory_bytes, mine.tflops) == ("my-gpu", True, 32e9, {"bf16": 200})
    assert mine.sources["tflops"] == here and datasheet_for(catalog, "Acme My GPU 32GB") is mine
    assert load_catalog(home=tmp_path / "elsewhere")["h100-sxm"].usd_per_hour == 2.69  # the cache untouched


def test_a_new_entry_missing_a_field_names_the_file_entry_and_field(tmp_path):
    write(tmp_path, {"my-gpu": {"name": "My GPU", "kind": "cuda", "memory_gb": 32, "tflops": {"bf16": 200}}})
    with pytest.raises(SpecError, match=r"\.yaml: devices\.my-gpu\.memory_bandwidth_gbs: Field required"):
        load_catalog(home=tmp_path)
    write(tmp_path, {"l4": {"tflops": {"fp4": 485}}})
    with pytest.raises(SpecError, match=r"devices\.l4\.tflops\.fp4: Input should be 'fp32'"):
        load_catalog(home=tmp_path)
    write(tmp_path, {"l4": {"usd_per_hour": 1, "price": {"usd_per_hour": 2}}})
    with pytest.raises(SpecError, match=r"devices\.l4: either usd_per_hour or price, not both"):
        load_catalog(home=tmp_path)
    write(tmp_path, {"l4": {"memory_gbs": 24}})
    with pytest.raises(SpecError, match=r"devices\.l4\.memory_gbs: Extra inputs are not permitted"):
        load_catalog(home=tmp_path)


def test_reserved_keys_clashing_names_and_a_malformed_file_are_refused(tmp_path):
    path = tmp_path / CATALOG_FILE
    write(tmp_path, {"cpu": {"usd_per_hour": 0.1}})
    with pytest.raises(SpecError, match=r"devices\.cpu: 'cpu' is reserved: the local CPU is measured"):
        load_catalog(home=tmp_path)
    write(tmp_path, {"My_GPU": {"name": "x"}})
    with pytest.raises(SpecError, match=r"devices\.My_GPU: a key is lowercase letters, digits and '-'"):
        load_catalog(home=tmp_path)
    write(tmp_path, {"l4": {"aliases": ["h100"]}})
    with pytest.raises(SpecError, match=rf"{path}: devices\.l4\.aliases: 'h100' already names h100-sxm"):
        load_catalog(home=tmp_path)
    path.write_text("devices:\n  l4: {usd_per_hour: 1\n")
    with pytest.raises(SpecError, match=rf"{path}: not valid YAML"):
        load_catalog(home=tmp_path)
    path.write_text("- a list")
    with pytest.raises(SpecError, match=rf"{path}: a mapping with `devices:`"):
        load_catalog(home=tmp_path)
    path.unlink()
    path.mkdir()  # unreadable as a file
    with pytest.raises(SpecError, match=rf"{path}: cannot read the device catalog"):
        load_catalog(home=tmp_path)
