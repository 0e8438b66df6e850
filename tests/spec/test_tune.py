"""A search's tune section: every searched key one the job has, every range one it takes, refused before
anything runs with the key named."""

from pathlib import Path

import pytest
import yaml

from gpuforge.errors import SpecError
from gpuforge.spec import load_search, load_spec
from tests.helpers.specs import image_spec

DIGITS = image_spec(Path("."), max_steps=30, eval_every=10, batch_size=64, lr=3.0e-3)
TUNE = {
    "objective": {"metric": "eval_accuracy"},
    "parameters": {"train.lr": {"loguniform": [1.0e-4, 3.0e-2]}},
    "pruner": {"asha": {"min_steps": 10}},
}


def _write(tmp_path: Path, job: dict, tune: dict | None = TUNE, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**job, **({"tune": tune} if tune is not None else {})}))
    return path


def _refused(tmp_path, tune_changes: dict | None = None, job: dict = DIGITS, tune: dict | None = None) -> str:
    tune = tune if tune is not None else {**TUNE, **(tune_changes or {})}
    with pytest.raises(SpecError) as err:
        load_search(_write(tmp_path, job, tune))
    return str(err.value)


def test_a_search_loads_with_its_job_and_a_trial_spec_sets_the_values(tmp_path):
    search = load_search(_write(tmp_path, DIGITS))
    assert search.tune.direction() == "maximize" and search.tune.max_trials == 20
    trial = search.trial_spec({"train.lr": 0.002, "model.options.channels": 4}, name="t1")
    assert trial.train.lr == 0.002 and trial.model.options == {"channels": 4} and trial.name == "t1"
    assert search.job.train.lr == 3.0e-3  # the job itself is untouched


def test_the_tune_section_may_be_a_file_beside_any_job_spec(tmp_path):
    job = _write(tmp_path, DIGITS, tune=None, name="job.yaml")
    tune = tmp_path / "tune.yaml"
    tune.write_text(yaml.safe_dump(TUNE))
    assert load_search(job, tune).tune.parameters["train.lr"].loguniform == (1.0e-4, 3.0e-2)
    both = _write(tmp_path, DIGITS)
    with pytest.raises(SpecError, match="give one"):
        load_search(both, tune)
    with pytest.raises(SpecError, match="no tune: section"):
        load_search(job)


@pytest.mark.parametrize(
    "parameters, told",
    [
        (
            {"train.lrr": {"uniform": [0.1, 0.2]}},
            "tune.parameters.train.lrr: not a key of the spec; did you mean train.lr?",
        ),
        ({"train.learning_rate": {"uniform": [0.1, 0.2]}}, "did you mean train.lr?"),
        ({"adapt.lora": {"choice": [None]}}, "tune.parameters.adapt.lora: is a section"),
        ({"adapt.lora.r": {"choice": [4, 8]}}, "this job has no adapt.lora section"),
        (
            {"train.lr": {"uniform": [-1.0, 1.0]}},
            "tune.parameters.train.lr: -1.0 is not a value this job takes",
        ),
        ({"train.max_steps": {"uniform": [10, 21]}}, "tune.parameters.train.max_steps: 15.5 is not a value"),
        ({"train.precision": {"choice": ["bf16", "fp8"]}}, "'fp8' is not a value this job takes"),
        ({"lr": {"uniform": [0.1, 0.2]}}, "tune.parameters.lr: expected a spec key such as train.lr"),
        ({"resources.devices": {"choice": [1, 2]}}, "resources.devices is the job's"),
        ({"data.train": {"choice": ["/etc/passwd"]}}, "not what it reads"),
    ],
)
def test_a_searched_key_the_job_lacks_or_a_range_it_cannot_take_is_refused_by_name(
    tmp_path, parameters, told
):
    assert told in _refused(tmp_path, {"parameters": parameters})


@pytest.mark.parametrize(
    "changes, told",
    [
        (
            {"objective": {"metric": "eval_perplexity"}},
            "tune.objective.metric: eval_perplexity is not a figure",
        ),
        ({"parameters": {"train.lr": {"uniform": [0.2, 0.1]}}}, "the low end must be below the high end"),
        ({"parameters": {"train.lr": {"loguniform": [0, 0.1]}}}, "both ends must be above 0"),
        ({"parameters": {"train.lr": {"uniform": [0.1, 0.2], "choice": [0.1]}}}, "give exactly one of"),
        ({"parameters": {}}, "tune.parameters"),
        ({"sampler": "grid"}, "sampler grid: train.lr has a continuous range"),
        ({"pruner": "hyperbandd"}, "tune.pruner"),
        ({"max_trials": 0}, "tune.max_trials: must be >= 1"),
        ({"budget": {"usd": -1}}, "tune.budget.usd: must be > 0"),
        ({"objectve": {"metric": "eval_loss"}}, "tune.objectve: unknown key"),
        ({"pruner": {"hyperband": {"pause": True}}}, "hyperband.pause: pausing at rungs is asha's"),
    ],
)
def test_a_bad_tune_section_is_refused_naming_the_key(tmp_path, changes, told):
    assert told in _refused(tmp_path, changes)


def test_a_pruner_needs_evaluations_during_training(tmp_path):
    job = {**DIGITS, "train": {k: v for k, v in DIGITS["train"].items() if k != "eval_every"}}
    assert "tune.pruner: asha judges trials at their evaluations: set train.eval_every" in _refused(
        tmp_path, job=job
    )
    load_search(
        _write(tmp_path, job, {**TUNE, "pruner": "none"})
    )  # no pruner: an evaluation at the end is enough


def test_a_grid_search_runs_each_point_once_at_most(tmp_path):
    grid = {"train.lr": {"choice": [0.001, 0.01]}, "train.batch_size": {"int": [16, 18]}}
    tune = {**TUNE, "sampler": "grid", "max_trials": 50, "parameters": grid}
    assert load_search(_write(tmp_path, DIGITS, tune)).tune.max_trials == 6


def test_a_grid_too_large_to_list_is_refused(tmp_path):
    wide = {f"model.options.k{i}": {"int": [1, 100]} for i in range(6)}  # 10^12 points
    told = _refused(tmp_path, {"sampler": "grid", "parameters": wide})
    assert "sampler grid: 1,000,000,000,000 points, over 10,000; use tpe or random" in told


def test_train_refuses_a_spec_with_a_tune_section_and_says_which_verb_runs_it(tmp_path):
    with pytest.raises(SpecError, match="gpuforge tune SPEC"):
        load_spec(_write(tmp_path, DIGITS))
