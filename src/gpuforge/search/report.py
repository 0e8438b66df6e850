"""What `gpuforge tune show` says of a search: its state, its trials, the best so far, the parameters'
importances, and what it spent and has left: one dictionary, for the table, `--json` and the page."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gpuforge.search.study import SearchStudy, TrialRecord
from gpuforge.spec import TuneSpec


def best_trial(trials: list[TrialRecord], direction: str) -> TrialRecord | None:
    """The best finished trial (a pruned or stopped trial's figure is from before its end: not a model's)."""
    finished = [t for t in trials if t.state == "finished" and t.value is not None]
    if not finished:
        return None
    pick = max if direction == "maximize" else min
    return pick(finished, key=lambda t: t.value)


def _left(limit: float | None, spent: float) -> float | None:
    return None if limit is None else max(0.0, limit - spent)


def describe(
    study: SearchStudy, state: dict[str, Any], tune: TuneSpec, trials: list[TrialRecord] | None = None
) -> dict[str, Any]:
    """`trials`: the study's, as the caller knows them better (a server: each its job's state and cost)."""
    trials = study.trials() if trials is None else trials
    best = best_trial(trials, study.direction)
    spent_usd = sum(t.cost_usd for t in trials)
    device_hours = sum(t.device_s for t in trials) / 3600
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    return {
        "state": state.get("state"),
        "reason": state.get("reason"),
        "objective": {"metric": study.metric, "direction": study.direction},
        "max_trials": tune.max_trials,
        "counts": counts,
        "trials": [
            {**{k: v for k, v in asdict(t).items() if k != "curve"}, "curve": [list(p) for p in t.curve]}
            for t in trials
        ],
        "best": None
        if best is None
        else {
            "trial": best.number,
            "job": best.job,
            "value": best.value,
            "params": best.params,
            "run": best.run,
        },  # fmt: skip
        "importances": study.importances(),
        "spent_usd": spent_usd,
        "device_hours": device_hours,
        "budget": {
            "usd": tune.budget.usd,
            "hours": tune.budget.hours,
            "usd_left": _left(tune.budget.usd, spent_usd),
            "hours_left": _left(tune.budget.hours, device_hours),
        },
    }
