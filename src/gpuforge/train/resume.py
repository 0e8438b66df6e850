"""Going on with a run directory: only the same job, and only forward from its newest checkpoint.

A run directory holds one job. Running `gpuforge train` again on it resumes from its newest checkpoint;
a spec that differs in anything but the keys of RESUMABLE_CHANGES (and RESUMABLE_SECTIONS) is refused
before anything is written.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from gpuforge.errors import RunDirError
from gpuforge.runs import RunDir, RunSummary
from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.train")

# Keys that may differ between the spec of a stored run and the spec that resumes it.
RESUMABLE_CHANGES = {
    ("train", "max_steps"),
    ("train", "epochs"),
    ("name",),
    ("cost", "budget_usd"),
    ("script", "max_restarts"),  # how many crashes the job survives, not what it computes
    ("resources", "devices"),  # the global batch of a step does not depend on how many processes share it
    ("distributed", "max_restarts"),
    ("distributed", "timeout_s"),
    ("train", "profile"),  # which steps are recorded, not what they compute (the whole section)
}
# Sections that may differ as a whole: where a run's figures are also sent does not change the run (and a
# run stored before the section existed has none)
RESUMABLE_SECTIONS = {"tracking"}
# Keys added since runs were first stored, by their defaults: a stored spec without one meant the default
ADDED_KEYS = {
    ("train", "early_stop"): None,
    ("train", "stop_at"): None,
    ("train", "keep_best"): False,
    ("train", "fast_dropout"): True,
    ("train", "schedule"): "auto",
    ("train", "eval_max_examples"): None,
    ("data", "group_by_length"): False,
}
# Defaults changed since runs were first stored: a stored spec from before (without the key that came with
# the change) holding the old default meant "the default", and matches a spec that leaves the key unset
# today. train.warmup_ratio was 0.05 of every run; it now depends on what trains. Either way the resumed
# run keeps the schedule it ran: its checkpoint's (train/schedule.py Shape.kept).
CHANGED_DEFAULTS = {("train", "warmup_ratio"): (0.05, None, "schedule")}


def check_same_job(run: RunDir, spec: JobSpec) -> None:
    """Resuming is only for the same job: refuse a run directory that holds another spec."""
    if not run.spec_path.exists():
        return
    stored = yaml.safe_load(run.spec_path.read_text()) or {}
    current = spec.model_dump(mode="json")
    for (section, key), (old, new, came_with) in CHANGED_DEFAULTS.items():
        held, now = stored.get(section), current.get(section, {}).get(key)
        if isinstance(held, dict) and came_with not in held and held.get(key) == old and now == new:
            held[key] = new
    for (section, key), default in ADDED_KEYS.items():
        if isinstance(stored.get(section), dict):
            stored[section].setdefault(key, default)
    differing = [
        key
        for key in _diff_keys(stored, current)
        if not any(key[: len(change)] == change for change in RESUMABLE_CHANGES)
        and key[0] not in RESUMABLE_SECTIONS
    ]
    if differing:
        names = ", ".join(".".join(k) for k in differing[:5])
        raise RunDirError(
            f"--out {run.root}: holds a run of a different spec (differs in {names}); "
            "use another --out to start a new run"
        )


def _diff_keys(a: Any, b: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            k for key in sorted(set(a) | set(b)) for k in _diff_keys(a.get(key), b.get(key), prefix + (key,))
        ]
    return [] if a == b else [prefix]


def check_not_past(run: RunDir, checkpoint_step: int | None, total_steps: int) -> None:
    """A run already past the steps asked for cannot go back to them."""
    if checkpoint_step is not None and checkpoint_step > total_steps:
        raise RunDirError(
            f"--out {run.root}: holds a run already at step {checkpoint_step}, past the {total_steps} "
            "steps asked for"
        )


def finished_already(
    run: RunDir, resumed_from: int | None, total_steps: int, ended_early: bool = False
) -> RunSummary | None:
    """The summary of a run that finished all `total_steps` before, or that train.early_stop or stop_at
    ended (`ended_early`, as its checkpoint says): rerunning it has nothing to do."""
    if resumed_from is None or (resumed_from < total_steps and not ended_early):
        return None
    finished = run.read_summary()
    if finished is None or finished.status != "finished":
        return None
    log.info("%s: already finished at step %d; nothing to do", run.root, resumed_from)
    return finished
