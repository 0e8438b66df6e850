"""A search's `tune:` section: what to search (spec keys and their ranges), what to optimise, how to sample
and prune, how many trials and at what cost; and the check that each searched key is one the job has and
each value of its range one the key takes, before anything runs.

It sits in a job spec (`tune:` beside model, data, train...) or in a file of its own (`gpuforge tune SPEC
--tune FILE`, the section's keys at the top). A trial's spec is the job's with the trial's values set,
as `--set` would set them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gpuforge.errors import SpecError
from gpuforge.spec.jobs import JobSpec
from gpuforge.spec.load import parse_spec
from gpuforge.spec.overrides import set_key
from gpuforge.spec.problems import MAX_PROBLEMS, section_at, suggest_key, validation_problems
from gpuforge.spec.sections import EVAL_METRICS, Section

Direction = Literal["minimize", "maximize"]
Scalar = str | int | float | bool | None
MAX_PARAMETERS = 32
MAX_CHOICES = 100
MAX_GRID = 10_000  # points of a grid search


class Objective(Section):
    metric: str = Field(
        description="an evaluation's figure as metrics.jsonl names it: eval_accuracy, eval_loss"
    )
    direction: Direction | None = Field(
        None, description="default: minimize a metric named *loss* or *perplexity*, maximize any other"
    )


class Parameter(Section):
    """One searched key's range: exactly one of uniform, loguniform, int (both ends included) or choice."""

    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    int_range: tuple[int, int] | None = Field(None, alias="int")
    choice: list[Scalar] | None = Field(None, min_length=1, max_length=MAX_CHOICES)

    model_config = {**Section.model_config, "populate_by_name": True}

    @model_validator(mode="after")
    def _one_range(self) -> Parameter:
        given = [
            name
            for name in ("uniform", "loguniform", "int_range", "choice")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of uniform: [low, high], loguniform: [low, high], "
                             "int: [low, high] or choice: [a, b, ...]")  # fmt: skip
        bounds = self.uniform or self.loguniform or self.int_range
        if bounds is not None:
            low, high = bounds
            if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
                raise ValueError(f"[{low}, {high}]: the low end must be below the high end")
            if self.loguniform is not None and low <= 0:
                raise ValueError(f"loguniform [{low}, {high}]: both ends must be above 0")
        if self.choice is not None and len({repr(v) for v in self.choice}) != len(self.choice):
            raise ValueError("choice: the same value twice")
        return self

    @property
    def kind(self) -> str:
        return "int" if self.int_range is not None else next(
            k for k in ("uniform", "loguniform", "choice") if getattr(self, k) is not None
        )  # fmt: skip

    def probes(self) -> list[Scalar]:
        """The values that show whether the key takes this range: both ends and a middle (a float
        range on an integer key fails there), or every choice."""
        if self.choice is not None:
            return list(self.choice)
        if self.int_range is not None:
            return list(self.int_range)
        low, high = self.uniform or self.loguniform
        middle = math.sqrt(low * high) if self.loguniform else (low + high) / 2
        return [low, middle, high]


class Asha(Section):
    min_steps: int | None = Field(
        None, ge=1, description="the first rung, in steps; default: the first evaluation (train.eval_every)"
    )
    reduction_factor: int = Field(3, ge=2, le=16, description="1 trial in this many goes on at each rung")
    pause: bool = Field(
        False,
        description="asha, local searches: a trial at a rung that too few trials have reached to judge it "
        "(fewer than reduction_factor) pauses at a checkpoint while new trials take its place, then "
        "resumes if it is in the best 1/reduction_factor once they have (else it is pruned); off: ASHA "
        "judges it at once against the few there",
    )


class Median(Section):
    warmup_steps: int = Field(0, ge=0, description="no trial is pruned before this step")
    startup_trials: int = Field(5, ge=1, description="no trial is pruned before this many have finished")


class Pruner(Section):
    """Exactly one of asha (asynchronous successive halving), hyperband, median; or none."""

    asha: Asha | None = None
    hyperband: Asha | None = None
    median: Median | None = None

    @model_validator(mode="after")
    def _one(self) -> Pruner:
        if sum(x is not None for x in (self.asha, self.hyperband, self.median)) > 1:
            raise ValueError("give one of asha, hyperband, median")
        if self.hyperband is not None and self.hyperband.pause:
            raise ValueError("hyperband.pause: pausing at rungs is asha's (hyperband has its own brackets)")
        return self

    @property
    def kind(self) -> str:
        return next((k for k in ("asha", "hyperband", "median") if getattr(self, k) is not None), "none")


class Budget(Section):
    usd: float | None = Field(
        None, gt=0, description="the search ends (budget_spent) once its trials cost this"
    )
    hours: float | None = Field(None, gt=0, description="... or once they held devices this many hours")

    def spent(self, usd: float, device_s: float) -> str | None:
        """Why a search that spent this is over its budget, or None."""
        if self.usd is not None and usd >= self.usd:
            return f"spent ${usd:.4f} of its ${self.usd:g} budget"
        if self.hours is not None and device_s >= self.hours * 3600:
            return f"held devices {device_s / 3600:.3f} h of its {self.hours:g} h budget"
        return None

    def pays_for(self, usd: float, device_s: float, cheapest: tuple[float, float] | None) -> bool:
        """Whether what is left after spending this pays for the cheapest trial that reached an evaluation
        so far (dollars, device-seconds): a trial that could not reach one before the budget ends is not
        started."""
        if cheapest is None:
            return True
        if self.usd is not None and self.usd - usd < cheapest[0]:
            return False
        return self.hours is None or self.hours * 3600 - device_s >= cheapest[1]


class TuneSpec(Section):
    objective: Objective
    parameters: dict[str, Parameter] = Field(min_length=1, max_length=MAX_PARAMETERS)
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Pruner = Field(default_factory=Pruner)
    max_trials: int = Field(20, ge=1, le=1000)
    parallel: int = Field(1, ge=1, le=64, description="trials at once (still within quotas and free devices)")
    budget: Budget = Field(default_factory=Budget)
    seed: int | None = Field(None, ge=0, lt=2**32, description="the sampler's seed: the same trials again")

    @field_validator("pruner", mode="before")
    @classmethod
    def _named_pruner(cls, value: Any) -> Any:
        if value is None or value == "none":
            return {}
        if isinstance(value, str):
            return {
                value: {}
            }  # `pruner: asha` means asha with its defaults; an unknown name is refused there
        return value

    @model_validator(mode="after")
    def _grid(self) -> TuneSpec:
        if self.sampler == "grid":
            ranged = [k for k, p in self.parameters.items() if p.kind in ("uniform", "loguniform")]
            if ranged:
                raise ValueError(f"sampler grid: {ranged[0]} has a continuous range; give it choice or int")
            if self.grid_size() > MAX_GRID:  # the sampler lists every point: a bound on its work
                raise ValueError(
                    f"sampler grid: {self.grid_size():,} points, over {MAX_GRID:,}; use tpe or random"
                )
            if self.max_trials > self.grid_size():  # (an assignment validates again: this time it holds)
                self.max_trials = self.grid_size()
        return self

    def grid_size(self) -> int:
        size = 1
        for p in self.parameters.values():
            size *= len(p.choice) if p.choice is not None else p.int_range[1] - p.int_range[0] + 1
        return size

    def direction(self) -> Direction:
        if self.objective.direction is not None:
            return self.objective.direction
        metric = self.objective.metric
        return "minimize" if "loss" in metric or "perplexity" in metric else "maximize"


@dataclass
class SearchSpec:
    """A search, checked: its tune section and the job each trial varies (the raw spec, paths resolved)."""

    tune: TuneSpec
    job: JobSpec
    job_raw: dict[str, Any]

    def first_rung(self) -> int:
        """The step of a pruner's first rung: asha's (hyperband's) min_steps, else the first evaluation."""
        asha = self.tune.pruner.asha or self.tune.pruner.hyperband
        return (asha.min_steps if asha and asha.min_steps else None) or self.job.train.eval_every or 1

    def trial_spec(self, params: dict[str, Any], name: str | None = None) -> JobSpec:
        """The job with a trial's values set (checked again: a value inside a checked range is one the
        key takes, but the spec's rules between keys still apply). A trial does not compress its model:
        compressing is for the model the search finds, not for each one it tries."""
        raw = copy.deepcopy(self.job_raw)
        raw.pop("compress", None)
        for key, value in params.items():
            set_key(raw, key, value)
        if name is not None:
            raw["name"] = name
        spec = parse_spec(raw, Path("."), origin="the trial's spec")
        assert isinstance(spec, JobSpec)
        return spec


def _where(key: str) -> str:
    return f"tune.parameters.{key}"


# what a search may not vary: what a job reads, where it runs and what it costs are the job's, checked once
FIXED_KEYS = (
    "name", "kind", "priority", "resources", "cost", "distributed", "tracking", "compress",
    "model.source", "data.train", "data.eval", "data.tokenizer",
)  # fmt: skip


def _check_key(job: JobSpec, key: str) -> None:
    """A searched key must be a field (not a section) of a section this job has, and not a FIXED_KEYS."""
    path = tuple(key.split("."))
    if not all(path) or len(path) < 2:
        raise SpecError(f"{_where(key)}: expected a spec key such as train.lr")
    if any(key == fixed or key.startswith(fixed + ".") for fixed in FIXED_KEYS):
        raise SpecError(
            f"{_where(key)}: a search varies how a job trains, not what it reads, where it runs or what it "
            f"costs: {key} is the job's"
        )
    if len(path) == 3 and path[:2] == ("model", "options"):
        return  # the builder's own keyword arguments: a free mapping, checked where the model is built
    section = section_at(path[:-1])
    if section is None or path[-1] not in section.model_fields:
        hint = suggest_key(path) if section is not None else None
        raise SpecError(f"{_where(key)}: not a key of the spec" + (f"; did you mean {hint}?" if hint else ""))
    if section_at(path) is not None:
        raise SpecError(f"{_where(key)}: is a section; search one of its keys ({key}.<key>)")
    node: Any = job
    for depth, part in enumerate(path[:-1]):
        node = getattr(node, part)
        if node is None:
            missing = ".".join(path[: depth + 1])
            raise SpecError(
                f"{_where(key)}: this job has no {missing} section, so {key} means nothing here "
                f"(set {missing} in the job's spec to search it)"
            )


def _check_range(job_raw: dict[str, Any], key: str, parameter: Parameter) -> None:
    for value in parameter.probes():
        raw = copy.deepcopy(job_raw)
        set_key(raw, key, value)
        try:
            parse_spec(raw, Path("."), origin="the job")
        except SpecError as err:
            raise SpecError(f"{_where(key)}: {value!r} is not a value this job takes: {err}") from None


def check_search(tune: TuneSpec, job: JobSpec, job_raw: dict[str, Any]) -> SearchSpec:
    """Every searched key one the job has and every probe of its range one it takes; an objective the job's
    evaluation reports, and the evaluations a pruner judges at. Each problem a SpecError naming it."""
    for key, parameter in tune.parameters.items():
        _check_key(job, key)
        _check_range(job_raw, key, parameter)
    reported = EVAL_METRICS[job.model.task]
    if tune.objective.metric not in reported:
        raise SpecError(
            f"tune.objective.metric: {tune.objective.metric} is not a figure this job's evaluation reports "
            f"(a {job.model.task} job's: {', '.join(reported)})"
        )
    if job.data.eval is None and job.data.eval_fraction == 0:
        raise SpecError("tune.objective: needs an eval set (data.eval, or data.eval_fraction above 0)")
    kind = tune.pruner.kind
    if kind != "none" and job.train.eval_every is None and "train.eval_every" not in tune.parameters:
        raise SpecError(
            f"tune.pruner: {kind} judges trials at their evaluations: set train.eval_every "
            "(without it a trial evaluates only at its end)"
        )
    return SearchSpec(tune=tune, job=job, job_raw=job_raw)


def parse_tune(raw: Any, origin: str) -> TuneSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{origin}: the tune section must be a mapping (objective, parameters, ...)")
    try:
        return TuneSpec.model_validate(raw)
    except ValidationError as err:
        told = [
            f"tune.{path}: {msg}" if path else f"tune: {msg}"
            for path, msg in validation_problems(err, MAX_PROBLEMS)
        ]
        raise SpecError(f"{origin}: {'; '.join(told)}") from None


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}{where}: malformed YAML") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file") from None


def load_search(
    spec_path: str | Path, tune_path: str | Path | None = None, overrides: list[str] = ()
) -> SearchSpec:
    """A search from a job spec with a `tune:` section, or a job spec and a tune file (not both)."""
    spec_path = Path(spec_path)
    raw = _read_yaml(spec_path)
    if not isinstance(raw, dict):
        raise SpecError(f"{spec_path}: the spec must be a mapping of sections (model, data, train, ...)")
    tune_raw = raw.pop("tune", None)
    if tune_path is not None:
        if tune_raw is not None:
            raise SpecError(
                f"{spec_path}: has a tune: section and --tune {tune_path} names another: give one"
            )
        tune_raw, origin = _read_yaml(Path(tune_path)), str(tune_path)
    elif tune_raw is None:
        raise SpecError(f"{spec_path}: no tune: section (what to search); add one, or give --tune FILE")
    else:
        origin = str(spec_path)
    tune = parse_tune(tune_raw, origin)
    # parse_spec applies the overrides and resolves the paths in the dict it is given: that dict is what a
    # trial's spec starts from, so that it reads the same from any directory
    job_raw = copy.deepcopy(raw)
    job = parse_spec(job_raw, spec_path.resolve().parent, overrides, default_name=spec_path.stem,
                     origin=str(spec_path))  # fmt: skip
    if not isinstance(job, JobSpec):
        raise SpecError(f"{spec_path}: kind: script: a search varies a job gpuforge trains")
    return check_search(tune, job, job_raw)
