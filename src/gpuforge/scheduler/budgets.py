"""Which projects have spent their month's budget (store/ledger.py): the loop pauses their running jobs
and the queue holds their queued ones, until the admin raises the budget or the month turns (UTC). A
project at 80 % and at 100 % of it is told once each a month (store/outbox.py), in the tick's transaction
that charged the spend."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.store import outbox
from gpuforge.store.ledger import month_spend
from gpuforge.store.models import Project, utcnow

REFRESH_S = 2.0  # a month's sum over the ledger is not read every half-second tick


class ProjectBudgets:
    def __init__(self) -> None:
        self.spent: dict[int, str] = {}  # project id -> why it may run nothing more this month
        self.names: dict[int, str] = {}  # project id -> name
        self.caps: dict[int, int] = {}  # project id -> max_devices
        self.shares: dict[int, float] = {}  # project id -> share
        self._read_at = 0.0

    def read_again(self) -> None:
        """At the next refresh, whatever the time (an admin raised a budget: no job paused after that)."""
        self._read_at = 0.0

    def refresh(self, s: Session) -> None:
        if time.monotonic() - self._read_at < REFRESH_S:
            return
        self._read_at = time.monotonic()
        now = utcnow()
        projects = list(s.scalars(select(Project)))
        self.names = {p.id: p.name for p in projects}
        self.caps = {p.id: p.max_devices for p in projects if p.max_devices is not None}
        self.shares = {p.id: p.share for p in projects}
        budgeted = [p for p in projects if p.budget_usd_month is not None]
        spend = month_spend(s, now) if budgeted else {}
        self.spent = {
            p.id: (
                f"project {p.name}'s budget for {now:%Y-%m} (${p.budget_usd_month:g}) is spent "
                f"(${spend.get(p.id, 0.0):.4f}); the admin can raise it: gpuforge projects set {p.name} "
                "--budget-usd-month X"
            )
            for p in budgeted
            if spend.get(p.id, 0.0) >= p.budget_usd_month
        }
        for p in budgeted:
            _tell_levels(s, p, spend.get(p.id, 0.0), now)


def _tell_levels(s: Session, project: Project, spend_usd: float, now) -> None:
    """Add the outbox's event of each level of its budget the project's spend has reached; the outbox
    keeps one a month of each (a read of its unique name: no memory here that a rolled-back tick could
    leave wrong)."""
    for kind, share in outbox.BUDGET_LEVELS.items():
        if spend_usd >= share * project.budget_usd_month:
            outbox.budget_event(s, project, kind, spend_usd, now)
