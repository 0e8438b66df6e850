"""A project at 80 % and at 100 % of its month's budget is told once each, however many ticks (and
servers) see it, in the transaction of the tick that read the spend."""

from __future__ import annotations

from sqlalchemy import select

from gpuforge.scheduler.budgets import ProjectBudgets
from gpuforge.store.db import session
from gpuforge.store.ledger import minute_of
from gpuforge.store.models import LedgerEntry, NotificationEvent, Project, utcnow


def _spend(engine, project_id: int, usd: float, subject: str) -> None:
    with session(engine) as s:
        s.add(LedgerEntry(subject=subject, minute=minute_of(utcnow()), project_id=project_id, usd=usd,
                          device_seconds=1.0))  # fmt: skip


def _refresh(engine, budgets: ProjectBudgets) -> None:
    """One tick's look at the budgets (read_again: the tick does not wait for REFRESH_S)."""
    budgets.read_again()
    with session(engine) as s:
        budgets.refresh(s)


def _kinds(engine) -> list[str]:
    with session(engine) as s:
        return list(s.scalars(select(NotificationEvent.kind).order_by(NotificationEvent.id)))


def test_80_and_100_percent_are_told_once_each_a_month(engine):
    with session(engine) as s:
        vision = Project(name="vision", budget_usd_month=10.0)
        s.add_all([vision, Project(name="free")])  # no budget: never told
        s.flush()
        project_id = vision.id
    budgets, other_server = ProjectBudgets(), ProjectBudgets()
    _spend(engine, project_id, 7.9, "job:1")
    _refresh(engine, budgets)
    assert _kinds(engine) == []
    _spend(engine, project_id, 0.2, "job:2")  # 8.1 of 10
    for _ in range(3):
        _refresh(engine, budgets)
        _refresh(engine, other_server)
    assert _kinds(engine) == ["budget.80"]
    _spend(engine, project_id, 2.0, "job:3")  # 10.1 of 10: spent
    _refresh(engine, other_server)
    _refresh(engine, budgets)
    assert _kinds(engine) == ["budget.80", "budget.100"]
    assert project_id in budgets.spent
    with session(engine) as s:
        told = s.scalars(select(NotificationEvent).order_by(NotificationEvent.id)).all()
        assert [e.subject for e in told] == [f"project:{project_id}"] * 2
        assert told[1].data["project"]["percent"] == 100 and "its jobs pause" in told[1].data["text"]


def test_a_tick_rolled_back_tells_nothing_and_the_next_one_tells(engine):
    with session(engine) as s:
        vision = Project(name="vision", budget_usd_month=1.0)
        s.add(vision)
        s.flush()
        project_id = vision.id
    _spend(engine, project_id, 0.9, "job:1")
    budgets = ProjectBudgets()
    try:
        with session(engine) as s:
            budgets.refresh(s)
            raise RuntimeError("the tick failed before its commit")
    except RuntimeError:
        pass
    assert _kinds(engine) == []
    _refresh(engine, budgets)
    assert _kinds(engine) == ["budget.80"]
