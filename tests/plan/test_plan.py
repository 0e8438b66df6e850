"""The pre-flight plan, checked against the real run of the same job (both in their own processes)."""

import json
import os
import re
from pathlib import Path

import pytest

from gpuforge.plan import dollars, duration
from gpuforge.plan.estimate import LocalStep
from gpuforge.train.batch import size
from tests.helpers.cli import run_cli
from tests.helpers.specs import write_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(*args, env=None):
    result = run_cli("plan", *args, "--json", env=env)
    return result, (json.loads(result.stdout) if result.stdout.strip().startswith("{") else None)


# every example is checked against its real run by benchmarks/plan_accuracy.py; here the quick one
@pytest.mark.slow
@pytest.mark.parametrize("example, steps", [("digits-cnn", 200)])  # a run of seconds: a burst ends in it
def test_plan_is_within_30_percent_of_the_measured_run(tmp_path, example, steps):
    """The machine is shared: a neighbour's burst slows the steps it lands on (a 6 ms step took 0.4 s
    under load), so one process's median can be 60x another's for the same work. So: plans and runs are
    interleaved, three of each, and the fastest step of each side over all three decides (a neighbour only
    adds time: the fastest step is the step's own cost, which is what the calibration measures; under load
    a quarter of a run's steps may all be slowed, and a plan's few steps all of them: with a two-rank
    neighbour on both cores each of its steps took 1.5x its own, in two plans of three, in CI); each on one
    thread (two threads wait for each other at every op, and a neighbour on either core
    stalls both). Whether the plan's median can be trusted is what its own spread says."""
    spec = str(EXAMPLES / f"{example}.yaml")
    one_thread = {"OMP_NUM_THREADS": "1"}
    pairs = []
    for attempt in range(3):
        result, plan = _plan(spec, "--measure", "--max-steps", str(steps), env=one_thread)
        assert result.returncode == 0, result.stderr
        assert plan["fits"] and plan["total_steps"] == steps and plan["parameters"] > 0
        memory = plan["memory"]
        parts = ("runtime", "weights", "gradients", "optimizer_state", "activations", "step_overhead")
        assert sum(memory[k] for k in parts) == memory["total"]
        assert plan["cost_usd"] == pytest.approx(plan["total_time_s"] * 0.10 / 3600)
        assert plan["step_time_reliable"] == (plan["step_time_spread"] <= 0.15)
        assert ("UNRELIABLE" in plan["step_time_method"]) == (not plan["step_time_reliable"])
        assert ("unreliable" in result.stderr) == (not plan["step_time_reliable"])
        assert plan["total_time_s"] == pytest.approx(
            plan["startup_s"] + plan["steps_time_s"] + plan["evaluation_s"]
        )

        run_dir = tmp_path / f"run{attempt}"
        trained = run_cli("train", spec, "--out", str(run_dir), "--max-steps", str(steps), env=one_thread)
        assert trained.returncode == 0, trained.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert memory["total"] == pytest.approx(summary["peak_mem_bytes"], rel=0.30)  # memory: every time
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        # the work the plan's total counts beyond the steps is the run's: as many evaluations, checkpoints
        assert plan["evaluations"] == sum("eval_loss" in m for m in lines) > 0
        assert plan["checkpoints"] == sum(e["event"] == "checkpoint" for e in events)
        times = [m["step_time_s"] for m in lines if m.get("step_time_s") and m["step"] > 1]  # 1 warms up
        assert len(times) >= steps // 2
        pairs.append((plan["step_time_fastest_s"], min(times)))
    planned, measured = min(p for p, _ in pairs), min(m for _, m in pairs)
    assert planned / measured == pytest.approx(1.0, abs=0.30), pairs


def _mib(text: str) -> float:
    """The first size in a line of plan output, in MiB."""
    figure, unit = re.search(r"([\d.]+) (GiB|MiB|KiB)", text).groups()
    return float(figure) * {"GiB": 1024, "MiB": 1, "KiB": 1 / 1024}[unit]


@pytest.mark.slow
def test_a_job_that_cannot_fit_is_refused_with_only_what_would_fit():
    spec = str(EXAMPLES / "minilm-topics.yaml")
    _, roomy = _plan(spec)
    # 82% of its need: LoRA (no gradients or AdamW state for the base: ~76%) fits; checkpointing
    # (activations) and a batch of 1 (~87%, by this machine's runtime overhead) do not
    budget_mib = int(roomy["memory"]["total"] * 0.82 / 2**20)
    result, plan = _plan(spec, "--set", f"resources.max_memory={budget_mib}MiB")
    assert result.returncode == 2 and plan is not None and not plan["fits"]
    line = result.stderr.strip().splitlines()[-1]
    assert line == f"gpuforge: error: {plan['verdict']}"
    assert line.startswith("gpuforge: error: does not fit: needs")
    assert f"more than the {budget_mib} MiB of resources.max_memory; would fit with adapt.lora" in line
    assert plan["suggestions"] and all(_mib(s.split(": ", 1)[1]) <= budget_mib for s in plan["suggestions"])
    assert not any("gradient_checkpointing" in s for s in plan["suggestions"])


@pytest.mark.slow
def test_a_budget_the_runtime_alone_exceeds_is_refused_by_plan_and_train_alike(
    tmp_path, tiny_bert_dir, small_topics
):
    # a transformers model, so that every suggestion (a smaller batch, LoRA, checkpointing) is a candidate
    # and each is refused; a tiny one: what is over the budget is the runtime, whatever the model's size
    spec = str(
        write_spec(
            tmp_path / "spec.yaml",
            {
                "name": "tiny-topics",
                "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
                "data": {"train": str(small_topics), "max_length": 32},
                "train": {"max_steps": 20, "batch_size": 8, "lr": 1e-3, "precision": "fp32"},
            },
        )
    )
    result, plan = _plan(spec, "--set", "resources.max_memory=100MB")
    assert result.returncode == 2 and plan["suggestions"] == []
    assert plan["memory"]["runtime"] > plan["capacity_bytes"]
    assert "the runtime alone" in plan["verdict"] and plan["verdict"].endswith("nothing can fit")
    trained = run_cli(
        "train", spec, "--set", "resources.max_memory=100MB", "--max-steps", "2", "--out", str(tmp_path / "r")
    )
    assert trained.returncode == 2 and not (tmp_path / "r" / "summary.json").exists()
    line = trained.stderr.strip().splitlines()[-1]
    assert line.startswith("gpuforge: error: does not fit: needs") and line.endswith("nothing can fit")
    assert "more than the 95.4 MiB of resources.max_memory" in line  # 100 MB, as plan reads it


@pytest.mark.slow
def test_a_budget_that_fits_trains(tmp_path):
    # without the example's compress section: pruning, recovering and timing the variants come after the
    # training this test is about (tests/test_examples.py runs the example with them)
    trained = run_cli(
        "train", str(EXAMPLES / "digits-cnn.yaml"), "--set", "resources.max_memory=8GiB",
        "--set", "compress={}", "--max-steps", "2", "--out", str(tmp_path / "r"),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_plan_its_compare_row_and_measure_give_one_step_time_and_the_total_says_what_it_holds():
    """One owner of this device's step time (plan/estimate.py): plain `plan` prints the figure `--compare`
    gives this CPU, and `--measure` prints it beside its measured median; all from the one cached
    `gpuforge hw` measurement, so equal to the last digit. The total is start-up + steps + evaluations."""
    spec = str(EXAMPLES / "digits-cnn.yaml")
    shown = run_cli("plan", spec)
    assert shown.returncode == 0, shown.stderr
    rows = _rows(shown.stdout)
    compared_run, compared = _plan(spec, "--compare", "cpu")
    measured_run, measured = _plan(spec, "--measure")
    assert compared_run.returncode == 0 and measured_run.returncode == 0, measured_run.stderr
    estimate = compared["targets"]["cpu"]["step_s"]
    assert rows["step time"].startswith(f"{duration(estimate)} (an estimate: the job's traced step")
    assert "lower bound" not in rows["step time"]
    assert measured["step_time_estimate_s"] == estimate  # the same traced step on the same figures
    assert measured["step_time_kind"] == "measured"
    assert f"estimated {duration(estimate)} without measuring" in measured["step_time_method"]
    assert estimate > measured["step_time_bound_s"] > 0  # the FLOP bound: no step is faster

    steps, evaluations = measured["total_steps"], measured["evaluations"]
    assert evaluations == steps // 40 + (1 if steps % 40 else 0)  # train.eval_every: 40, and the last step
    assert measured["checkpoints"] == (steps - 1) // 40 + 1  # train.checkpoint_every: 40, and the end's
    assert rows["time: steps"] == f"{steps} x {duration(estimate)} = {duration(steps * estimate)}"
    assert re.fullmatch(rf"{evaluations} x [\d.]+ ms", rows["time: evaluations"])
    started = rows["time: start-up"]
    # any unit plan.duration writes: a slow or busy machine takes past 120 s, written "2 min"
    any_duration = r"[\d.]+ (?:ms|s|min|h)"
    assert re.fullmatch(rf"{any_duration} \(the process, data, model and batch, timed here\)", started)
    assert re.fullmatch(
        rf"{steps} steps, {any_duration}, ([\d.]+|under 0.0001) cents at \$0.1/h \(start-up, steps and "
        rf"evaluations; not timed: {measured['checkpoints']} checkpoint writes of [\d.]+ KiB\)",
        rows["total"],
    )
    assert rows["memory: weights"].endswith("KiB")  # 29,258 fp32 parameters
    assert compared["targets"]["cpu"]["total_time_s"] == pytest.approx(
        steps * estimate + compared["targets"]["cpu"]["evaluation_s"]
    )  # --compare's total: the steps and the evaluations, as its notes say


def _rows(table: str) -> dict[str, str]:
    """The plan table's rows, a figure wrapped over several lines joined again."""
    rows: dict[str, str] = {}
    for line in table.splitlines():
        if len(cells := line.split("│")) == 4:
            what, figure = cells[1].strip(), cells[2].strip()
            if what:
                rows[last := what] = figure
            else:
                rows[last] += " " + figure
    return rows


def test_a_step_time_from_flops_alone_says_it_is_a_lower_bound():
    bound = LocalStep(roofline_s=None, bound_s=0.085)  # a device `gpuforge hw` has no figures for
    assert bound.kind == "lower bound" and bound.seconds == 0.085 and bound.factor == 1.0
    assert bound.method().startswith("a lower bound: FLOPs / measured matmul peak")
    estimate = LocalStep(roofline_s=0.274, bound_s=0.085)
    assert estimate.kind == "estimate" and estimate.seconds == 0.274
    assert "lower bound" not in estimate.method()


def test_figures_read_in_units_that_fit_them():
    assert [size(n) for n in (500, 117_032, 100_000_000, 3 * 2**30)] == [
        "0.488 KiB", "114 KiB", "95.4 MiB", "3.00 GiB",
    ]  # fmt: skip
    assert [duration(s) for s in (0.00143, 3.7, 500, 10_000)] == ["1.43 ms", "3.7 s", "8 min", "2.8 h"]
    assert [dollars(u) for u in (7e-6, 1e-8, 0.0123, 0.5, 123.456)] == [
        "0.0007 cents", "under 0.0001 cents", "1.2 cents", "50 cents", "$123.46",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_fraction_of_the_device_says_what_it_changes_in_the_plan():
    whole, plan = _plan(str(EXAMPLES / "digits-cnn.yaml"))
    half, shared = _plan(str(EXAMPLES / "digits-cnn.yaml"), "--set", "resources.devices=0.5")
    assert whole.returncode == 0 and half.returncode == 0, (whole.stderr, half.stderr)
    assert plan["share"] == "" and shared["share"].startswith("0.5 of the CPU slot: ")
    cores = os.cpu_count() and len(os.sched_getaffinity(0))
    slower = cores / max(1, round(cores / 2))
    # the step measured on the whole machine, slowed by its share of the cores (two runs differ a little)
    assert shared["step_time_s"] == pytest.approx(plan["step_time_s"] * slower, rel=0.5)
    assert f"steps x{slower:.2g}" in shared["share"]
    assert shared["fits"] and shared["capacity_bytes"] == pytest.approx(plan["capacity_bytes"], rel=0.1)
