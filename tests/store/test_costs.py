"""Spend read back from the ledger (store/costs.py): the period a request may ask for, who sees whose
spend, the sums by day, key and project, and the jobs that ran with no price set."""

import re
from datetime import UTC, date, datetime, timedelta

import pytest

from gpuforge.store.costs import MAX_COST_DAYS, costs_for, period
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey
from tests.store.test_ledger import _job, _setup, _tick

TODAY = date(2026, 3, 11)


def test_a_period_defaults_to_the_30_days_up_to_today():
    when = period(None, "", TODAY)
    assert (when.since, when.until) == (TODAY - timedelta(days=29), TODAY)
    assert len(when.days) == 30 and when.days[-1] == "2026-03-11"
    assert when.end - when.start == timedelta(days=30)
    assert period("2026-03-01", None, TODAY).days[0] == "2026-03-01"


@pytest.mark.parametrize(
    ("since", "until", "words"),
    [
        ("March", None, "since: 'March' is not a day; give YYYY-MM-DD"),
        (None, "2026-02-30", "until: '2026-02-30' is not a day"),
        (None, "2027-03-13", "until: 2027-03-13 is more than a year ahead"),
        ("2025-03-10", None, "since: 2025-03-10 is more than a year back; the costs go back to 2025-03-11"),
        ("2026-03-11", "2026-03-10", "since..until: 2026-03-11..2026-03-10 must be 1 to 366 days"),
        ("2025-03-11", "2026-03-12", f"must be 1 to {MAX_COST_DAYS} days, since first"),
    ],
)
def test_a_period_that_cannot_be_answered_says_what_is_wrong(since, until, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        period(since, until, TODAY)


def _ledger(engine) -> dict[str, int]:
    """ada (vision) runs a priced job and an unpriced one, bob (nlp) a priced one, over a UTC midnight."""
    ids = _setup(engine)
    late = datetime(2026, 3, 10, 23, 59, 0, tzinfo=UTC)
    ids["a"] = _job(engine, ids["ada"], ids["vision"], accrued_at=late)
    ids["b"] = _job(engine, ids["bob"], ids["nlp"], accrued_at=late, usd_per_hour=36.0)
    ids["free"] = _job(engine, ids["ada"], ids["vision"], accrued_at=late, usd_per_hour=0.0)
    _tick(engine, late + timedelta(seconds=150))
    return ids


def test_an_admin_sees_every_keys_spend_biggest_spender_first(engine):
    ids = _ledger(engine)
    with session(engine) as s:
        root = s.get(ApiKey, ids["root"])
        spent = costs_for(s, root, period("2026-03-10", "2026-03-11", TODAY), "key")
    assert [g.key for g in spent.groups] == ["bob", "ada"]  # bob's rate is ten times ada's
    assert spent.keys == ["ada", "bob"]
    ada = spent.groups[1]
    assert (ada.jobs, ada.unpriced, ada.device_hours) == (2, 1, pytest.approx(2 * 150 / 3600))
    assert spent.total_usd == pytest.approx(sum(g.usd for g in spent.groups))
    assert [(r.day, r.key) for r in spent.rows] == [
        ("2026-03-10", "ada"), ("2026-03-10", "bob"), ("2026-03-11", "ada"), ("2026-03-11", "bob")
    ]  # fmt: skip
    (free,) = spent.unpriced
    assert (free.subject, free.kind, free.id, free.name) == (f"job:{ids['free']}", "job", ids["free"], "j")
    assert free.device_hours == pytest.approx(150 / 3600)


def test_a_member_sees_its_own_and_its_projects_spend_and_no_other_project(engine):
    ids = _ledger(engine)
    when = period("2026-03-10", "2026-03-11", TODAY)
    with session(engine) as s:
        ada = s.get(ApiKey, ids["ada"])
        spent = costs_for(s, ada, when, "project")
        assert [(g.project, g.jobs) for g in spent.groups] == [("vision", 2)]
        assert costs_for(s, ada, when, "day", project="vision").total_usd == spent.total_usd
        for other in ("nlp", "nowhere"):
            with pytest.raises(LookupError, match=f"^no project {other}$"):
                costs_for(s, ada, when, "day", project=other)
