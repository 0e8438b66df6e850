"""What a search is expected to cost before it runs: its trials times the plan of one trial, times the
share of a trial's steps its pruner is expected to leave, capped by its budget.

ASHA (and Hyperband's brackets, roughly) keep 1 trial in `reduction_factor` at each rung (min_steps x
factor^k), so of T trials about T/factor^k train past rung k: the expected steps of a trial are the sum over
the rungs' segments of each one's length times the share of trials that reach it. That is the expected
case when the trials' figures are what ASHA assumes (independent); the worst case is that no trial is
pruned (each one better than those before it at every rung: the whole of each trial). Every trial pays its
start-up whatever its length. A median pruner's share depends on the figures: the range is from
its warm-up to the whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpuforge.spec import SearchSpec


@dataclass(frozen=True)
class SearchPlan:
    trials: int
    trial_time_s: float  # one whole trial: start-up, steps and evaluations
    trial_cost_usd: float
    expected_step_share: float  # of a trial's steps, what the pruner is expected to leave on average
    low_time_s: float  # device-seconds, all the trials, pruned as expected
    high_time_s: float  # none pruned
    low_usd: float
    high_usd: float
    budget_usd: float | None
    budget_hours: float | None
    pruner: str
    capped: str | None = None  # what of its budget stops it before its last trial, when it does

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        from gpuforge.plan import dollars, duration  # noqa: PLC0415 (the plan's own wording of both)

        share = f"{self.pruner} expected to leave {self.expected_step_share:.0%} of a trial's steps"
        return (
            f"search: {self.trials} trials of {duration(self.trial_time_s)}, {dollars(self.trial_cost_usd)} "
            f"each; {duration(self.low_time_s)}-{duration(self.high_time_s)} of device time, "
            f"{dollars(self.low_usd)}-{dollars(self.high_usd)} ({share}; the high end: none pruned)"
            + (f"; {self.capped}" if self.capped else "")
        )


def expected_step_share(search: SearchSpec, total_steps: int) -> float:
    """The share of a trial's `total_steps` its pruner is expected to leave it, on average over trials."""
    pruner = search.tune.pruner
    asha = pruner.asha or pruner.hyperband
    if asha is None:
        if pruner.median is not None:
            return min(1.0, max(pruner.median.warmup_steps, search.job.train.eval_every or 1) / total_steps)
        return 1.0
    factor, rung = asha.reduction_factor, search.first_rung()
    steps, reach, start = 0.0, 1.0, 0
    while rung < total_steps:
        steps += (rung - start) * reach
        start, rung, reach = rung, rung * factor, reach / factor
    steps += (total_steps - start) * reach
    return steps / total_steps


def plan_search(search: SearchSpec, trial_time_s: float, startup_s: float, usd_per_hour: float,
                total_steps: int) -> SearchPlan:  # fmt: skip
    tune = search.tune
    share = expected_step_share(search, total_steps)
    trial_low = startup_s + (trial_time_s - startup_s) * share  # the start-up is paid whatever the length
    low, high = tune.max_trials * trial_low, tune.max_trials * trial_time_s
    rate = usd_per_hour / 3600
    capped = []
    budget_s = tune.budget.hours * 3600 if tune.budget.hours is not None else None
    if budget_s is not None:
        if budget_s < high:
            capped.append(f"its budget stops it at {tune.budget.hours:g} device-hours")
        low, high = min(low, budget_s), min(high, budget_s)
    low_usd, high_usd = low * rate, high * rate
    if tune.budget.usd is not None:
        if tune.budget.usd < high_usd:
            capped.append(f"its budget stops it at ${tune.budget.usd:g}")
        low_usd, high_usd = min(low_usd, tune.budget.usd), min(high_usd, tune.budget.usd)
    return SearchPlan(
        trials=tune.max_trials, trial_time_s=trial_time_s, trial_cost_usd=trial_time_s * rate,
        expected_step_share=share, low_time_s=low, high_time_s=high, low_usd=low_usd, high_usd=high_usd,
        budget_usd=tune.budget.usd, budget_hours=tune.budget.hours, pruner=tune.pruner.kind,
        capped=", ".join(capped) or None,
    )  # fmt: skip
