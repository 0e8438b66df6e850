"""A `tune:` section in Optuna's terms: the parameters' distributions, the sampler and the pruner."""

from __future__ import annotations

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from gpuforge.spec import SearchSpec, TuneSpec


def distributions(tune: TuneSpec) -> dict[str, BaseDistribution]:
    space: dict[str, BaseDistribution] = {}
    for key, p in tune.parameters.items():
        if p.choice is not None:
            space[key] = CategoricalDistribution(p.choice)
        elif p.int_range is not None:
            space[key] = IntDistribution(*p.int_range)
        elif p.loguniform is not None:
            space[key] = FloatDistribution(*p.loguniform, log=True)
        else:
            space[key] = FloatDistribution(*p.uniform)
    return space


def tpe_startup_trials(max_trials: int) -> int:
    """Random trials before TPE models the results: Optuna's 10 is most of a small search; a third of
    it, at least 3, leaves TPE room to work."""
    return max(3, min(10, max_trials // 3))


def sampler(tune: TuneSpec) -> optuna.samplers.BaseSampler:
    if tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=tune.seed)
    if tune.sampler == "grid":
        grid = {
            key: list(p.choice) if p.choice is not None else list(range(p.int_range[0], p.int_range[1] + 1))
            for key, p in tune.parameters.items()
        }
        return optuna.samplers.GridSampler(grid, seed=tune.seed)
    # multivariate: lr and warm-up interact; constant_liar: trials asked while others run are spread out
    return optuna.samplers.TPESampler(
        seed=tune.seed,
        n_startup_trials=tpe_startup_trials(tune.max_trials),
        multivariate=True,
        constant_liar=tune.parallel > 1,
    )


def pruner(search: SearchSpec) -> optuna.pruners.BasePruner:
    spec = search.tune.pruner
    if spec.asha is not None:
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=search.first_rung(), reduction_factor=spec.asha.reduction_factor
        )
    if spec.hyperband is not None:
        return optuna.pruners.HyperbandPruner(
            min_resource=search.first_rung(),
            max_resource=search.job.train.max_steps or "auto",
            reduction_factor=spec.hyperband.reduction_factor,
        )
    if spec.median is not None:
        return optuna.pruners.MedianPruner(
            n_startup_trials=spec.median.startup_trials, n_warmup_steps=spec.median.warmup_steps
        )
    return optuna.pruners.NopPruner()
