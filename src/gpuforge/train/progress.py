"""How a running job shows itself: nothing (tests, servers) or a rich progress bar (CLI)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn


class Reporter:
    """Silent by default; the engine calls start, step (per logged step) and stop."""

    def start(self, total_steps: int, start_step: int) -> None: ...

    def step(self, record: dict[str, Any]) -> None: ...

    def stop(self) -> None: ...


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def eval_figure(record: dict[str, Any]) -> str | None:
    """The headline of an evaluation in a metrics record (`eval acc 0.812`), or None if it has none."""
    if record.get("eval_accuracy") is not None:
        return f"eval acc {record['eval_accuracy']:.3f}"
    if record.get("eval_perplexity") is not None:
        return f"eval ppl {record['eval_perplexity']:.2f}"
    if record.get("eval_loss") is not None:
        return f"eval loss {record['eval_loss']:.4f}"
    return None


class RichReporter(Reporter):
    """step, loss, the latest eval, samples/s, ETA and cost so far, on one live line."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None

    def start(self, total_steps: int, start_step: int) -> None:
        self.progress = Progress(
            TextColumn("step {task.completed:>5.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[eval]}"),  # empty until the first evaluation
            TextColumn("{task.fields[speed]} samples/s"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("${task.fields[cost]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task(
            "train",
            total=total_steps,
            completed=start_step,
            loss="-",
            eval="",
            speed="-",
            eta="--:--",
            cost="0",
        )
        self.progress.start()

    def step(self, record: dict[str, Any]) -> None:
        if self.progress is None:
            return
        loss = record.get("loss")
        if figure := eval_figure(record):  # a record has one only at an evaluation step: the bar keeps it
            self.progress.update(self.task, eval=figure)
        self.progress.update(
            self.task,
            completed=record["step"],
            loss=f"{loss:.4f}" if loss is not None else "nan",
            speed=f"{record['samples_per_s']:.1f}",
            eta=_duration(record.get("eta_s")),
            cost=f"{record['cost_usd']:.4f}",
        )

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
