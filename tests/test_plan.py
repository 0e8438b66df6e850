"""The pre-flight plan, checked against the real run of the same job (both in their own processes)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _plan(*args):
    result = run_cli("plan", *args, "--json")
    return result, (json.loads(result.stdout) if result.stdout.strip().startswith("{") else None)


@pytest.mark.parametrize("example, steps", [("digits-cnn", 30), ("minilm-topics", 8)])
def test_plan_is_within_30_percent_of_the_measured_run(tmp_path, example, steps):
    spec = str(EXAMPLES / f"{example}.yaml")
    # The machine is shared: a neighbour's burst can slow one of the two processes for seconds, and a
    # 5 ms step doubles. The claim is that plan and run agree under the same load, so a pair that
    # disagrees on time is measured again (at most three pairs); memory must agree every time.
    pairs = []
    for attempt in range(3):
        result, plan = _plan(spec, "--measure", "--max-steps", str(steps))
        assert result.returncode == 0, result.stderr
        assert plan["fits"] and plan["total_steps"] == steps and plan["parameters"] > 0
        memory = plan["memory"]
        parts = ("runtime", "weights", "gradients", "optimizer_state", "activations", "step_overhead")
        assert sum(memory[k] for k in parts) == memory["total"]
        assert plan["cost_usd"] == pytest.approx(plan["total_time_s"] * 0.10 / 3600)

        run_dir = tmp_path / f"run{attempt}"
        trained = run_cli("train", spec, "--out", str(run_dir), "--max-steps", str(steps))
        assert trained.returncode == 0, trained.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert memory["total"] == pytest.approx(summary["peak_mem_bytes"], rel=0.30)
        pairs.append((plan["step_time_s"], summary["median_step_s"]))
        if plan["step_time_s"] == pytest.approx(summary["median_step_s"], rel=0.30):
            return
    pytest.fail(f"planned vs measured step time (s) never within 30% in {len(pairs)} tries: {pairs}")


def test_a_job_that_cannot_fit_is_refused_with_what_would_fit():
    result, plan = _plan(str(EXAMPLES / "minilm-topics.yaml"), "--set", "resources.max_memory=700MiB")
    assert result.returncode == 2 and plan is not None and not plan["fits"]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("gpuforge: error: does not fit: needs") and "GiB more than the 0.68 GiB" in line
    assert "adapt.lora" in line and "gradient_checkpointing" in line


def test_plan_without_measuring_gives_a_lower_bound_from_flops():
    result, plan = _plan(str(EXAMPLES / "digits-cnn.yaml"))
    assert result.returncode == 0, result.stderr
    assert plan["step_time_method"].startswith("FLOPs / measured matmul peak")
    assert plan["step_time_s"] == pytest.approx(plan["flops_per_step"] / plan["device_peak_flops"])
