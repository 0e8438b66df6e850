"""A search's Optuna study, through ask and tell: which values a new trial tries, whether a trial's
evaluation at a step prunes it (and why, in figures), and how each trial ended.

The study lives in a database (Optuna's RDB storage: a SQLite file for a local search, the server's own
database for a server's), so a search outlives the process that drives it: a driver that starts again
opens the same study and finds each trial where it was. What Optuna does not keep, each trial's user
attributes do: `state` (gpuforge's words: running, finished, pruned, stopped, failed), `reason`,
`run` (its run directory or job id), `steps`, `cost_usd` and `device_s`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from gpuforge.run_files import json_line, read_lines
from gpuforge.runs import read_summary
from gpuforge.search.space import distributions, pruner, sampler
from gpuforge.spec import SearchSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)  # a trial's every tell is not news

# how a trial ends in gpuforge's words, and Optuna's state for each (a stopped trial keeps its figures, as a
# pruned one does); before its end a trial is `running` (a server's: its job's state, queued or running)
TRIAL_ENDS = {
    "finished": TrialState.COMPLETE,
    "pruned": TrialState.PRUNED,
    "stopped": TrialState.PRUNED,
    "failed": TrialState.FAIL,
}
_ENDED_AS = {TrialState.COMPLETE: "finished", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}


@dataclass(frozen=True)
class Taken:
    """What a trial's new metrics lines said: how far its file is read, its last step, and the reason
    to prune it (None: it goes on)."""

    offset: int
    last_step: int | None
    prune: str | None


@dataclass
class TrialRecord:
    """One trial as a search shows it."""

    number: int
    params: dict[str, Any]
    state: str
    value: float | None  # the objective: the last evaluation's (a finished trial's final figure)
    steps: int | None
    cost_usd: float
    device_s: float
    run: str | None  # a local search's run directory
    reason: str | None
    job: int | None = None  # a server's search: the trial's job
    curve: list[tuple[int, float]] = field(default_factory=list)  # the objective at each evaluation


MAX_STEP = 2**31  # a step past it is no real run's (and PostgreSQL's integer column would refuse it)
MAX_REPORTED = 20  # evaluations told to the study from one read of a trial's metrics


def _figure(value: Any) -> float | None:
    """A metrics value as a float (NaN and infinities kept: Optuna prunes a NaN), or None for one that is
    not a number or does not fit a float (an integer of 400 digits)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _shown(value: float) -> str:
    return f"{value:.4g}"


class SearchStudy:
    def __init__(self, search: SearchSpec, storage: str | optuna.storages.BaseStorage, name: str):
        """`storage`: a database URL, or an Optuna storage several studies share (a server's)."""
        self.search, self.name = search, name
        self.metric = search.tune.objective.metric
        self.direction = search.tune.direction()
        self.storage = optuna.storages.RDBStorage(storage) if isinstance(storage, str) else storage
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=name,
            direction=self.direction,
            sampler=sampler(search.tune),
            pruner=pruner(search),
            load_if_exists=True,
        )
        self._space = distributions(search.tune)
        self._study_id = self.storage.get_study_id_from_name(name)

    # --- asking and telling

    def ask(self) -> tuple[int, dict[str, Any]]:
        trial = self.study.ask(self._space)
        trial.set_user_attr("state", "running")
        return trial.number, dict(trial.params)

    def _trial(self, number: int) -> optuna.trial.Trial:
        return optuna.trial.Trial(self.study, self._trial_id(number))

    def note(self, number: int, **attrs: Any) -> None:
        trial = self._trial(number)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)

    def report(self, number: int, step: int, value: float) -> str | None:
        """One evaluation's objective at `step`: the reason to prune the trial there, or None. A step
        reported before (a driver that started again reads the trial's metrics from the top) is
        skipped."""
        frozen = self.frozen(number)
        if frozen.state != TrialState.RUNNING or step in frozen.intermediate_values:
            return None
        if not math.isfinite(value):
            value = float("nan")  # Optuna prunes a NaN at its rung
        trial = self._trial(number)
        trial.report(value, step)
        if not trial.should_prune():
            return None
        return self._prune_reason(number, step, value)

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self._study_id, number)

    def frozen(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self._trial_id(number))

    def finish(self, number: int, state: str, value: float | None = None, reason: str | None = None,
               **figures: Any) -> None:  # fmt: skip
        """Tell the study how the trial ended: its gpuforge state, its objective where it has one. Noted
        first (Optuna refuses a note on an ended trial), told after: drivers go by Optuna's own state, so
        one stopped between the two tells it again. A trial told before is left as it was."""
        if self.frozen(number).state != TrialState.RUNNING:
            return
        optuna_state = TRIAL_ENDS[state]
        if optuna_state == TrialState.COMPLETE and (value is None or not math.isfinite(value)):
            optuna_state = TrialState.FAIL  # a run that finished without a figure to rank by
            state, reason = "failed", reason or f"finished with no {self.metric}"
        self.note(number, state=state, reason=reason, **figures)
        try:
            self.study.tell(
                number, value if optuna_state == TrialState.COMPLETE else None, state=optuna_state
            )
        except RuntimeError:
            # the grid sampler calls study.stop() once the grid is covered, which only an objective
            # function may do; the trial's end is stored before it (Optuna's tell writes it in `finally`)
            if self.frozen(number).state == TrialState.RUNNING:
                raise

    def take_evaluations(self, number: int, metrics: Path, offset: int) -> Taken:
        """Report the trial's evaluations written past `offset` in its metrics.jsonl, the last
        MAX_REPORTED of them at most (each is a few writes to the study: a flood of lines costs a pass no
        more); stop at the first that prunes it. Untrusted lines: one that is not a step's record, whose
        step is out of bounds or whose objective is not a number, is skipped, never an error."""
        lines, end = read_lines(metrics, offset)
        last_step, evaluations = None, []
        for line in lines:
            record = json_line(line)
            step = record.get("step") if record is not None else None
            if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
                continue
            last_step = step
            value = _figure(record.get(self.metric))
            if value is not None:
                evaluations.append((step, value))
        for step, value in evaluations[-MAX_REPORTED:]:
            reason = self.report(number, step, value)
            if reason is not None:
                return Taken(end, last_step, reason)
        return Taken(end, last_step, None)

    def final_value(self, number: int, run_dir: Path) -> float | None:
        """The objective of a finished trial's model: its summary's last evaluation (keep_best's best),
        else the last evaluation it reported. The run's own figure, read as untrusted input."""
        try:
            summary = read_summary(Path(run_dir) / "summary.json")
        except (ValueError, OSError):
            summary = None
        figure = ((summary.eval if summary else None) or {}).get(self.metric.removeprefix("eval_"))
        if isinstance(figure, int | float) and not isinstance(figure, bool) and math.isfinite(figure):
            return float(figure)
        curve = self.frozen(number).intermediate_values
        return curve[max(curve)] if curve else None

    # --- a trial paused at a rung (tune.pruner.asha.pause)

    def rung_standing(self, number: int) -> tuple[int, float, list[float]] | None:
        """ASHA: the highest rung the trial has reached, its objective there and every trial's there (its
        own included); None before its first rung."""
        trials = self.study.get_trials(deepcopy=False)
        me = next(t for t in trials if t.number == number)
        rungs = [int(k.rsplit("_", 1)[1]) for k in me.system_attrs if k.startswith("completed_rung_")]
        if not rungs:
            return None
        key = f"completed_rung_{max(rungs)}"
        peers = [t.system_attrs[key] for t in trials if key in t.system_attrs]
        return max(rungs), me.system_attrs[key], peers

    def judge_paused(self, number: int, to_start: int) -> str | None:
        """A paused trial at its rung, by ASHA's rule of promotion (the best 1/reduction_factor of the
        trials there go on; the best alone while fewer are there): "resume" once it is among them,
        "wait" while the trials that may still reach the rung (running ones that have not yet, and the
        `to_start` still to start) could make it so, else the reason to prune it."""
        standing = self.rung_standing(number)
        if standing is None:
            return "resume"
        rung, value, peers = standing
        key = f"completed_rung_{rung}"
        on_the_way = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        may_come = to_start + sum(1 for t in on_the_way if key not in t.system_attrs)
        factor = self.search.tune.pruner.asha.reduction_factor
        if self.direction == "maximize":
            rank = 1 + sum(1 for v in peers if v > value)
        else:
            rank = 1 + sum(1 for v in peers if v < value)
        if rank <= max(1, len(peers) // factor):
            return "resume"
        if rank <= (len(peers) + may_come) // factor:  # if those to come all did worse
            return "wait"
        step = self.frozen(number).last_step
        return self._prune_reason(number, step if step is not None else 0, value)

    # --- why a trial was pruned, in figures

    def _prune_reason(self, number: int, step: int, value: float) -> str:
        metric, kind = self.metric, self.search.tune.pruner.kind
        if math.isnan(value):
            return f"pruned at step {step}: {metric} is not a number"
        trials = self.study.get_trials(deepcopy=False)
        if kind == "asha":
            me = next(t for t in trials if t.number == number)
            rung = max(int(k.rsplit("_", 1)[1]) for k in me.system_attrs if k.startswith("completed_rung_"))
            key = f"completed_rung_{rung}"
            peers = sorted(
                (t.system_attrs[key] for t in trials if key in t.system_attrs),
                reverse=self.direction == "maximize",
            )
            factor = self.search.tune.pruner.asha.reduction_factor
            cutoff = peers[max(0, len(peers) // factor - 1)]
            rung_step = self.search.first_rung() * factor**rung
            return (
                f"pruned at step {step}: {metric} {_shown(value)} is not in the best 1/{factor} of the "
                f"{len(peers)} trials that reached step {rung_step} (needed {_shown(cutoff)})"
            )
        if kind == "median":
            others = [
                t.intermediate_values[step]
                for t in trials
                if t.state == TrialState.COMPLETE and step in t.intermediate_values
            ]
            if others:
                middle = statistics.median(others)
                worse = "below" if self.direction == "maximize" else "above"
                return (
                    f"pruned at step {step}: {metric} {_shown(value)} is {worse} the median "
                    f"{_shown(middle)} of the {len(others)} finished trials at that step"
                )
        return f"pruned at step {step} by {kind}: {metric} {_shown(value)}"

    # --- reading it back

    def trials(self) -> list[TrialRecord]:
        records = []
        for t in self.study.get_trials(deepcopy=False):
            attrs = t.user_attrs
            state = attrs.get("state") or "running"
            if t.state == TrialState.RUNNING:  # (noted as ended, not told yet: a driver stopped between)
                state = "paused" if attrs.get("paused") else "running"
            elif state == "running":
                state = _ENDED_AS.get(t.state, "failed")
            curve = sorted(t.intermediate_values.items())
            value = t.value if t.state == TrialState.COMPLETE else (curve[-1][1] if curve else None)
            records.append(
                TrialRecord(
                    number=t.number,
                    params=dict(t.params),
                    state=state,
                    value=value if value is None or math.isfinite(value) else None,
                    steps=attrs.get("steps"),
                    cost_usd=float(attrs.get("cost_usd") or 0.0),
                    device_s=float(attrs.get("device_s") or 0.0),
                    run=attrs.get("run"),
                    reason=attrs.get("reason"),
                    job=attrs.get("job"),
                    curve=[(s, v) for s, v in curve if math.isfinite(v)],
                )
            )
        return records

    def running(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def importances(self) -> dict[str, float]:
        """Each parameter's share of the objective's variance over the finished trials (fANOVA), once
        there are enough of them to say; {} before."""
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(complete) < 3 or len(self._space) < 1:
            return {}
        if len(self._space) == 1:
            return {next(iter(self._space)): 1.0}
        try:
            found = optuna.importance.get_param_importances(self.study)
        except (RuntimeError, ValueError):  # every trial with the same value: nothing to apportion
            return {}
        return {k: float(v) for k, v in found.items()}
