"""When a single job ends before its last step, and which evaluation is its best: train.early_stop,
train.stop_at and train.keep_best.

Pure decisions over the evaluations' figures (no torch, no files). The loop hands each evaluation to
Watch.observe, by the names metrics.jsonl gives them (`eval_loss`, `eval_accuracy`, `eval_perplexity`):

    watch = Watch.from_spec(spec.train)                     # None when none of the keys is set
    decision = watch.observe(40, {"eval_loss": 0.41, "eval_accuracy": 0.91})
    decision.best   # this evaluation is the best so far: keep_best keeps its weights
    decision.stop   # why the job ends here ("reached eval_accuracy 0.91 >= 0.9 at step 40"), or None

- early_stop: the watched metric must improve on the best so far by more than min_delta (down for a
  minimized metric, up for a maximized one); after `patience` evaluations in a row that do not, the job
  stops. The best is the last evaluation that improved so: keep_best's too (as Keras's
  restore_best_weights has it).
- stop_at: the job stops at the first evaluation where ANY of its metrics reaches its threshold in the
  metric's direction (<= for a minimized metric, >= for a maximized one); a threshold is a goal, and one
  goal met is enough. Several met at once are all named.
- A metric is minimized when its name holds `loss` or `perplexity`, maximized otherwise, unless
  early_stop.direction says.

Its state (the best value, its step, the evaluations since without improvement, and the reason it ended
the job) is a few numbers that a checkpoint's meta.json carries, so a resumed run decides as one that
never stopped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

Direction = Literal["minimize", "maximize"]
MINIMIZED = ("loss", "perplexity")  # a metric whose name holds one of these is better lower
KEEP_BEST_METRIC = "eval_loss"  # what keep_best ranks by without early_stop


def direction_of(metric: str, direction: Direction | None = None) -> Direction:
    """`direction` where given; else minimize for a loss or perplexity, maximize for anything else."""
    if direction is not None:
        return direction
    return "minimize" if any(word in metric for word in MINIMIZED) else "maximize"


def reached(value: float, threshold: float, direction: Direction) -> bool:
    return value <= threshold if direction == "minimize" else value >= threshold


def _shown(value: float) -> str:
    return f"{value:.4g}"


@dataclass
class WatchState:
    """What a checkpoint keeps of a Watch."""

    best: float | None = None  # the best value of the watched metric so far
    best_step: int | None = None  # the step of that evaluation
    bad_evals: int = 0  # evaluations since it that did not improve on it by more than min_delta
    best_figures: dict[str, float] | None = None  # all the figures of that evaluation
    stopped: str | None = None  # why the job ended early, once it did


@dataclass(frozen=True)
class Decision:
    best: bool  # this evaluation is the best so far (by the watched metric)
    stop: str | None  # the reason to end the job after this evaluation, or None


class Watch:
    """The rules of one job. `patience` None: no early stopping, the best is tracked for keep_best only.
    `stop_at`: {metric: threshold}, each in its metric's direction."""

    def __init__(
        self,
        metric: str,
        direction: Direction,
        min_delta: float = 0.0,
        patience: int | None = None,
        stop_at: dict[str, float] | None = None,
    ):
        self.metric, self.direction, self.min_delta, self.patience = metric, direction, min_delta, patience
        self.stop_at = {m: (t, direction_of(m)) for m, t in (stop_at or {}).items()}
        self.state = WatchState()

    @classmethod
    def from_spec(cls, train: Any) -> Watch | None:
        """The rules of a TrainSpec, or None when it sets none of early_stop, stop_at and keep_best (the
        loop then does nothing more at an evaluation)."""
        early = train.early_stop
        if early is None and not train.stop_at and not train.keep_best:
            return None
        if early is None:
            metric = KEEP_BEST_METRIC
            return cls(metric, direction_of(metric), stop_at=train.stop_at)
        direction = direction_of(early.metric, early.direction)
        return cls(early.metric, direction, early.min_delta, early.patience, train.stop_at)

    def metrics(self) -> list[str]:
        """The metrics the rules read."""
        return list(dict.fromkeys([self.metric, *self.stop_at]))

    def improves(self, value: float) -> bool:
        best = self.state.best
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.direction == "minimize":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def observe(self, step: int, figures: dict[str, float]) -> Decision:
        """One evaluation at `step`, its figures by metric name: whether it is the best so far, and the
        reason to stop here (stop_at's before early_stop's: a goal met says more than a plateau)."""
        missing = [m for m in self.metrics() if m not in figures]
        if missing:
            raise KeyError(f"the evaluation at step {step} reports no {', '.join(missing)}")
        state, value = self.state, figures[self.metric]
        best = self.improves(value)
        if best:
            state.best, state.best_step, state.bad_evals = value, step, 0
            state.best_figures = dict(figures)
        else:
            state.bad_evals += 1
        goals = [
            f"{m} {_shown(figures[m])} {'<=' if d == 'minimize' else '>='} {t:g}"
            for m, (t, d) in self.stop_at.items()
            if reached(figures[m], t, d)
        ]
        if goals:
            return Decision(best, f"reached {', '.join(goals)} at step {step}")
        if self.patience is not None and state.bad_evals >= self.patience:
            since = (
                f"best {_shown(state.best)} at step {state.best_step}"
                if state.best is not None
                else "no finite value yet"
            )
            by = f" by {self.min_delta:g}" if self.min_delta else ""
            return Decision(
                best,
                f"stopped early at step {step}: {self.metric} did not improve{by} for "
                f"{state.bad_evals} evaluations ({since})",
            )
        return Decision(best, None)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """A checkpoint's state (none in one written before the rules were asked for: a fresh state)."""
        self.state = WatchState(**saved) if saved else WatchState()
