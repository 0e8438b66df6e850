"""Automatic micro-batch size, measured on the CPU against a memory budget (never by running out)."""

import pytest

from gpuforge.data import prepare_data
from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.models import ModelRequest, build_model, load_tokenizer
from gpuforge.runs import RunDir
from gpuforge.runtime.precision import Precision
from gpuforge.spec import DataSpec, load_spec, parse_spec
from gpuforge.train.batch import CPU_HEADROOM, longest_first, search_micro_batch
from gpuforge.train.engine import train
from tests.helpers.paths import TOPICS
from tests.helpers.specs import write_spec


@pytest.fixture(scope="module")
def minilm_job():
    tokenizer = load_tokenizer("bundled:minilm", "sequence-classification", None)
    data = prepare_data(DataSpec(train=str(TOPICS), max_length=64), "sequence-classification", tokenizer, 0)
    built = build_model(ModelRequest("bundled:minilm", "sequence-classification", num_labels=4))
    built.module.train()
    return built, data


def _search(minilm_job, global_batch, max_memory):
    import torch

    built, data = minilm_job
    return search_micro_batch(
        built,
        "sequence-classification",
        data.train,
        global_batch,
        Precision("fp32", ""),
        torch.device("cpu"),
        max_memory,
    )


@pytest.mark.slow
def test_the_largest_micro_batch_under_the_budget_wins(minilm_job):
    roomy = _search(minilm_job, 32, 64 * 2**30)
    assert roomy.micro == 32 and roomy.per_sample_bytes > 2**20  # MiniLM at 24 tokens: MiBs per sample
    # The first searches grow the process (allocator pools), so measure once more at its steady size, then
    # give a budget halfway between 8 and 32 samples: 12 samples of slack either way.
    roomy = _search(minilm_job, 32, 64 * 2**30)
    budget = int((roomy.predicted_bytes(8) + roomy.predicted_bytes(32)) / 2 / CPU_HEADROOM)
    tight = _search(minilm_job, 32, budget)
    assert 2 <= tight.micro < 32
    checked = [t for t in tight.trials if t["micro"] == tight.micro][-1]
    assert tight.persistent_bytes + checked["peak_bytes"] <= tight.budget_bytes


@pytest.mark.slow
def test_a_budget_below_one_sample_names_what_one_sample_needs(minilm_job):
    with pytest.raises(
        GpuforgeError, match=r"max_memory: 0.10 GiB is too small for a batch of one: that needs"
    ):
        _search(minilm_job, 64, 100 * 2**20)


def test_longest_examples_come_first(minilm_job):
    _, data = minilm_job
    order = longest_first(data.train)
    assert len(data.train.ids[order[0]]) == max(len(i) for i in data.train.ids)


def test_auto_needs_a_global_batch(tmp_path):
    spec = write_spec(
        tmp_path / "j.yaml",
        {
            "model": {"source": "bundled:minilm", "task": "sequence-classification"},
            "data": {"train": "x.jsonl"},
            "train": {"batch_size": "auto"},
        },
    )
    with pytest.raises(SpecError, match="train: global_batch_size is required with batch_size: auto"):
        load_spec(spec)


@pytest.mark.slow
def test_auto_in_a_run_is_reported_and_kept_on_resume(tmp_path, tiny_bert_dir, small_topics):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 32},
        "train": {"max_steps": 3, "batch_size": "auto", "global_batch_size": 32},
        "resources": {"max_memory": "16GiB"},
    }
    summary = train(parse_spec(raw, tmp_path), tmp_path / "run")
    assert summary["batch_size"] == 32 and summary["grad_accum"] == 1
    started = RunDir(tmp_path / "run").events()[0]
    assert started["batch_search"]["micro"] == 32 and started["batch_search"]["budget_source"].startswith(
        "resources.max_memory"
    )
    raw["train"]["max_steps"] = 4
    resumed = train(parse_spec(raw, tmp_path), tmp_path / "run")
    assert resumed["batch_search"] is None and resumed["batch_size"] == 32  # no second search


def test_train_refuses_a_job_over_its_memory_budget_before_it_writes(tmp_path, tiny_bert_dir, small_topics):
    raw = {
        "model": {"source": f"hf:{tiny_bert_dir}", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 32},
        "train": {"max_steps": 2, "batch_size": 8},
        "resources": {"max_memory": "1MiB"},
    }
    with pytest.raises(
        GpuforgeError,
        match=r"^does not fit: needs .+ more than the 1 MiB of resources.max_memory; the runtime alone .+"
        r"nothing can fit$",
    ):
        train(parse_spec(raw, tmp_path), tmp_path / "run")
    assert not (tmp_path / "run" / "events.jsonl").exists()
