"""`gpuforge plan --compare`: one job's memory, batch, step time, total time and cost on several devices."""

import json

import pytest
import yaml

from gpuforge.errors import SpecError
from gpuforge.plan.compare import compare, notes
from gpuforge.spec import load_spec
from tests.helpers.cli import run_cli
from tests.helpers.specs import write_spec


@pytest.fixture
def spec_path(tmp_path, tiny_bert_dir, small_topics, monkeypatch):
    monkeypatch.setenv("GPUFORGE_HOME", str(tmp_path / "home"))
    spec = {
        "name": "tiny-topics",
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 32},
        "train": {"max_steps": 20, "batch_size": 8, "lr": 1e-3, "precision": "fp32"},
        "cost": {"usd_per_hour": 0.25},
    }
    return write_spec(tmp_path / "spec.yaml", spec)


def _devices_file(tmp_path, devices: dict) -> None:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "devices.yaml").write_text(yaml.safe_dump({"devices": devices}))


def test_each_target_gets_its_fit_batch_step_time_and_cost_and_the_best_are_marked(spec_path):
    result = compare(load_spec(spec_path, []), ["h100", "l4", "cpu"])
    assert list(result.targets) == ["h100", "l4", "cpu"]
    for t in result.targets.values():
        assert t.fits and t.batch == 8 and t.grad_accum == 1 and t.step_s > 0
        assert t.total_time_s == pytest.approx(t.step_s * 20 + t.evaluation_s)
        assert t.total_cost_usd == pytest.approx(t.total_time_s / 3600 * t.usd_per_hour)
        assert sum(t.step_parts.values()) == pytest.approx(t.step_s)
    h100, l4, cpu = result.targets.values()
    assert h100.precision == "fp32" and h100.usd_per_hour > l4.usd_per_hour  # the catalog's prices
    assert cpu.usd_per_hour == 0.25 and "measured here" in cpu.source  # the spec's price: no prices.yaml
    assert l4.step_parts["memory_s"] > h100.step_parts["memory_s"]  # 300 GB/s against 3,350
    assert sum(t.fastest for t in result.targets.values()) == 1
    cheapest = min(result.targets.values(), key=lambda t: t.total_cost_usd)
    assert cheapest.cheapest and sum(t.cheapest for t in result.targets.values()) == 1
    assert notes(result)[-1].startswith("total: the steps")  # and what it leaves out


@pytest.mark.slow
def test_with_measure_the_estimate_is_scaled_by_this_machines_measured_step(spec_path):
    result = compare(load_spec(spec_path, []), ["cpu", "l4"], measure=True, calibration_s=0.5)
    calibration = result.calibration
    assert calibration["factor"] == pytest.approx(
        calibration["measured_step_s"] / calibration["roofline_step_s"]
    )
    assert result.targets["cpu"].step_s == pytest.approx(calibration["measured_step_s"])  # the same job, here
    unmeasured = compare(load_spec(spec_path, []), ["cpu"]).targets["cpu"]
    assert calibration["roofline_step_s"] == unmeasured.step_s  # `plan`'s estimate: one figure, one owner
    assert "x" in result.targets["l4"].source and "measured step" in result.targets["l4"].source


@pytest.mark.slow
def test_auto_batch_takes_the_largest_power_of_two_that_fits_and_a_job_that_fits_nowhere_says_by_how_much(
    spec_path, tmp_path
):
    spec = load_spec(spec_path, ["train.batch_size=auto", "train.global_batch_size=64"])
    roomy = compare(spec, ["l4"])
    per_sample = roomy.activations_per_sample_bytes
    assert per_sample > 0
    # room, under the 92% of its memory a run plans with, for 6 examples: a micro-batch of 4, not 8
    memory_gb = (roomy.targets["l4"].memory_bytes - 58 * per_sample) / 0.92 / 1e9
    _devices_file(tmp_path, {"small-gpu": {"name": "Small GPU", "kind": "cuda", "memory_gb": memory_gb,
                                           "memory_bandwidth_gbs": 100, "tflops": {"fp32": 10}}})  # fmt: skip
    squeezed = compare(spec, ["small-gpu", "l4"]).targets
    assert (
        squeezed["small-gpu"].fits
        and squeezed["small-gpu"].batch == 4
        and squeezed["small-gpu"].grad_accum == 16
    )
    assert squeezed["l4"].batch == 64 and squeezed["l4"].grad_accum == 1

    _devices_file(tmp_path, {"tiny-gpu": {"name": "Tiny GPU", "kind": "cuda", "memory_gb": 0.01,
                                          "memory_bandwidth_gbs": 100, "tflops": {"fp32": 10}}})  # fmt: skip
    home = {"GPUFORGE_HOME": str(tmp_path / "home")}
    assert (
        run_cli("plan", str(spec_path), "--compare", "tiny-gpu,l4", env=home).returncode == 0
    )  # the L4 will do
    nowhere = run_cli("plan", str(spec_path), "--compare", "tiny-gpu", env=home)
    assert nowhere.returncode == 2
    assert "fits on none of tiny-gpu: the closest is tiny-gpu (Tiny GPU)" in nowhere.stderr
    assert "short (needs" in nowhere.stderr


@pytest.mark.slow
def test_a_device_without_the_jobs_precision_is_estimated_at_its_nearest_and_says_so(spec_path, tmp_path):
    _devices_file(tmp_path, {"old-gpu": {"name": "Old GPU", "kind": "cuda", "memory_gb": 16,
                                         "memory_bandwidth_gbs": 900, "tflops": {"fp32": 15}}})  # fmt: skip
    result = compare(load_spec(spec_path, ["train.precision=bf16"]), ["old-gpu", "tpu-v5e", "cpu"]).targets
    assert result["old-gpu"].precision == "fp32" and "bf16 is not on its datasheet" in result["old-gpu"].note
    assert result["tpu-v5e"].precision == "bf16" and not result["tpu-v5e"].runs_gpuforge
    assert not result["tpu-v5e"].fastest and not result["tpu-v5e"].cheapest  # an estimate wins nothing
    fp16 = compare(load_spec(spec_path, ["train.precision=fp16"]), ["cpu"]).targets["cpu"]
    assert fp16.step_s > 0  # fp16 on this CPU: emulated or not, an estimate and no crash


def test_a_lora_job_whose_base_is_cast_is_traced_as_it_runs(spec_path, tmp_path):
    _devices_file(tmp_path, {"old-gpu": {"name": "Old GPU", "kind": "cuda", "memory_gb": 16,
                                         "memory_bandwidth_gbs": 900, "tflops": {"fp32": 15}}})  # fmt: skip
    lora = load_spec(spec_path, ["train.precision=bf16", "adapt.lora.r=4"])
    result = compare(lora, ["old-gpu", "cpu"]).targets
    assert all(t.fits and t.step_s > 0 for t in result.values())


def test_an_unpriced_cpu_has_no_cost_and_is_not_the_cheapest(spec_path):
    result = compare(load_spec(spec_path, ["cost.usd_per_hour=0"]), ["cpu", "l4"]).targets
    assert result["cpu"].usd_per_hour is None and result["cpu"].total_cost_usd is None
    assert result["l4"].cheapest and not result["cpu"].cheapest


@pytest.mark.slow
def test_json_has_one_entry_per_target_named_as_asked_and_a_bad_name_lists_the_known_ones(spec_path):
    result = run_cli("plan", str(spec_path), "--compare", "cpu,a100", "--json")
    assert result.returncode == 0, result.stderr
    targets = json.loads(result.stdout)["targets"]
    assert list(targets) == ["cpu", "a100"]
    for entry in targets.values():
        assert {"fits", "batch", "step_s", "total_time_s", "total_cost_usd"} <= set(entry)
    assert targets["a100"]["device"].startswith("NVIDIA A100") and "80GB" in targets["a100"]["device"]

    unknown = run_cli("plan", str(spec_path), "--compare", "h100,b200")
    assert unknown.returncode == 2
    assert "b200" in unknown.stderr and "h100-sxm" in unknown.stderr and "l4" in unknown.stderr
    with pytest.raises(SpecError, match="name at least one device"):
        compare(load_spec(spec_path, []), [" "])


@pytest.mark.slow
def test_a_distributed_job_pays_its_all_reduce_over_the_link_and_is_told_what_would_cut_it(spec_path):
    spec = load_spec(spec_path, ["resources.devices=2", "distributed.strategy=ddp"])
    slow = compare(spec, ["l4"], link_gbps=0.05).targets["l4"]
    assert slow.devices == 2 and slow.batch == 4  # each of the 2 devices takes half the global batch
    assert slow.step_parts["allreduce_s"] > 0.2 * slow.step_s
    assert any("powersgd cuts it to" in a and "0.05 Gbit/s" in a for a in slow.advice), slow.advice
    assert slow.total_cost_usd == pytest.approx(slow.total_time_s / 3600 * slow.usd_per_hour * 2)
    fast = compare(spec, ["l4"]).targets["l4"]  # the L4's own PCIe link
    assert fast.step_parts["allreduce_s"] < slow.step_parts["allreduce_s"]
    compressed = load_spec(spec_path, ["resources.devices=2", "distributed.strategy=ddp",
                                        "distributed.gradient_compression=powersgd"])  # fmt: skip
    cut = compare(compressed, ["l4"], link_gbps=0.05).targets["l4"]
    assert cut.step_parts["allreduce_s"] < slow.step_parts["allreduce_s"]
    calibrated = compare(spec, ["l4"], measure=True, link_gbps=0.05, calibration_s=0.5).targets["l4"]
    assert calibrated.step_parts["allreduce_s"] == pytest.approx(slow.step_parts["allreduce_s"])  # the link's


@pytest.mark.slow
def test_ranks_on_this_one_cpu_share_it_and_fsdp_shards_the_state_on_gpus(spec_path):
    one = compare(load_spec(spec_path, []), ["cpu"]).targets["cpu"]
    two = compare(load_spec(spec_path, ["resources.devices=2", "distributed.strategy=ddp"]), ["cpu"]).targets[
        "cpu"
    ]
    assert (
        two.batch == one.batch and two.step_s > one.step_s
    )  # no faster: the same cores, plus the all-reduce
    assert two.total_cost_usd == pytest.approx(two.total_time_s / 3600 * 0.25)  # one machine's price
    ddp = compare(load_spec(spec_path, ["resources.devices=4", "distributed.strategy=ddp"]), ["h100"]).targets
    fsdp = compare(
        load_spec(spec_path, ["resources.devices=4", "distributed.strategy=fsdp"]), ["h100"]
    ).targets
    assert fsdp["h100"].memory_bytes < ddp["h100"].memory_bytes
    assert fsdp["h100"].step_parts["allreduce_s"] == pytest.approx(
        1.5 * ddp["h100"].step_parts["allreduce_s"]
    )
