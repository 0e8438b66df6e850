"""<run>/summary.json through runs.RunSummary: the same file as before the model, old and new files load."""

import json
import math

import pytest

from gpuforge.runs import (
    OPTIONAL_KEYS,
    ReaderRunDir,
    RunDir,
    RunResult,
    RunSummary,
    read_summary,
    write_summary,
)

# A summary.json the engine wrote before RunSummary existed (examples/digits-cnn.yaml, 30 steps on a CPU).
WRITTEN = {
    "status": "finished",
    "reason": None,
    "steps": 30,
    "total_steps": 30,
    "resumed_from": None,
    "samples_per_s": 8179.71526308143,
    "tokens_per_s": None,
    "median_step_s": 0.007539632999396417,
    "peak_mem_bytes": 438968320,
    "final_loss": 0.0620187446475029,
    "eval": {"loss": 0.24716869503010613, "accuracy": 0.9749303621169917},
    "device": "AMD EPYC x2 threads",
    "device_type": "cpu",
    "precision": "fp32",
    "precision_reason": "asked for in the spec",
    "batch_size": 64,
    "grad_accum": 1,
    "global_batch_size": 64,
    "batch_search": None,
    "parameters": 29258,
    "trainable_parameters": 29258,
    "optimizer_state_bytes": 234104,
    "process_state_bytes": {"params": 117032, "grads": 0, "optimizer": 234104},
    "adapter": None,
    "weight_bytes": 117032,
    "flops_method": "measured (torch.utils.flop_counter)",
    "device_peak_flops": 179625470913.65457,
    "mfu": 0.3284653560352951,
    "cost_usd": 6.08327210000223e-05,
    "usd_per_hour": 0.1,
    "launch_attempt": None,
    "processes": 1,
    "strategy": "none",
    "gradient_compression": None,
    "comm_bytes_per_step": None,
    "wall_s": 2.1899816309996822,
}
ADDED_LATER = (  # keys the first summaries lacked
    "batch_search",
    "optimizer_state_bytes",
    "process_state_bytes",
    "adapter",
    "weight_bytes",
    "launch_attempt",
    "processes",
    "strategy",
    "gradient_compression",
    "comm_bytes_per_step",
)


def test_the_file_is_byte_for_byte_what_the_engine_wrote_before(tmp_path):
    path = tmp_path / "summary.json"
    write_summary(path, RunSummary.model_validate(WRITTEN))
    assert path.read_text() == json.dumps(WRITTEN, indent=2) + "\n"  # keys, order, values, layout
    always = [k for k in RunSummary.model_fields if k not in OPTIONAL_KEYS]
    assert always[1:] == list(WRITTEN)  # after schema_version: the file's keys
    # a run that measured its energy writes it after them, with its source
    measured = RunSummary.model_validate({**WRITTEN, "energy_j": 12.5, "energy_source": "rapl: x"})
    assert list(measured.as_dict())[-2:] == list(OPTIONAL_KEYS)


def test_a_summary_round_trips_typed(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(WRITTEN))
    summary = read_summary(path)
    assert summary.schema_version == 1  # a file without the field is version 1
    assert summary.status == "finished" and summary.steps == 30 and summary.eval["accuracy"] > 0.97
    assert summary.process_state_bytes == {"params": 117032, "grads": 0, "optimizer": 234104}
    assert summary.as_dict() == WRITTEN
    write_summary(path, summary)
    assert read_summary(path) == summary


def test_a_newer_file_loads_and_keeps_what_it_added(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"schema_version": 2, **WRITTEN, "energy_kwh": 0.5}))
    summary = read_summary(path)
    assert summary.schema_version == 2 and summary.model_extra == {"energy_kwh": 0.5}
    write_summary(path, summary)
    written = json.loads(path.read_text())
    assert written["schema_version"] == 2 and written["energy_kwh"] == 0.5 and written["steps"] == 30


def test_an_older_file_without_the_later_keys_loads_with_their_defaults(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({k: v for k, v in WRITTEN.items() if k not in ADDED_LATER}))
    summary = read_summary(path)
    assert summary.processes == 1 and summary.strategy == "none"  # true of every run before DDP
    assert summary.launch_attempt is None and summary.weight_bytes is None and summary.steps == 30


def test_nan_is_written_as_null_and_read_back_as_none(tmp_path):
    path = tmp_path / "summary.json"
    write_summary(path, RunSummary.model_validate({**WRITTEN, "median_step_s": math.nan}))
    assert json.loads(path.read_text())["median_step_s"] is None
    assert read_summary(path).median_step_s is None


def test_no_file_is_none_and_another_file_is_an_error(tmp_path):
    path = tmp_path / "summary.json"
    assert read_summary(path) is None
    for text in ("[]", json.dumps({k: v for k, v in WRITTEN.items() if k != "status"}), '{"status": "fin'):
        path.write_text(text)
        with pytest.raises(ValueError):
            read_summary(path)
    path.write_text(json.dumps({**WRITTEN, "steps": "many"}))
    with pytest.raises(ValueError, match="steps"):
        read_summary(path)


def test_the_run_directory_reads_and_writes_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    assert run.read_summary() is None and run.summary() is None
    summary = RunSummary.model_validate(WRITTEN)
    ReaderRunDir(run.root).write_summary(summary)  # ranks past 0 write nothing
    assert not run.summary_path.exists()
    run.write_summary(summary)
    assert run.read_summary() == summary and run.summary() == WRITTEN


def test_a_result_is_the_summary_and_the_signal_that_stopped_it():
    summary = RunSummary.model_validate({**WRITTEN, "status": "cancelled"})
    result = summary.as_result(signal=15)
    assert result == {**WRITTEN, "status": "cancelled", "signal": 15}
    typed = RunResult.model_validate(result)
    assert typed.signal == 15 and typed.status == "cancelled"
    assert RunResult.model_validate(summary.as_result(None)).signal is None
