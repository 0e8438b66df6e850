"""Device-time lately, by key and by project, from the ledger: a minute that just ended counts whole, one a
half-life old counts half, one older than the horizon is not read."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from gpuforge.scheduler.usage import recent_usage
from gpuforge.store.db import session
from gpuforge.store.keys import create_key
from gpuforge.store.ledger import minute_of
from gpuforge.store.models import ApiKey, LedgerEntry, Project, utcnow


def test_recent_usage_decays_by_half_a_half_life_per_key_and_per_project(engine):
    now = utcnow()
    this_minute = minute_of(now)
    hour = timedelta(hours=1)
    with session(engine) as s:
        vision = Project(name="vision")
        s.add(vision)
        s.flush()
        create_key(s, "ada")
        create_key(s, "bob")
        s.flush()
        ada, bob = (s.scalar(select(ApiKey.id).where(ApiKey.name == n)) for n in ("ada", "bob"))

        def used(key, project, minute, device_seconds, subject="job:1"):
            s.add(LedgerEntry(subject=subject, minute=minute, key_id=key, project_id=project,
                              device_seconds=device_seconds, usd=0.0))  # fmt: skip

        used(ada, None, this_minute, 120.0)  # 2 devices this minute: whole
        used(ada, None, this_minute - hour, 60.0, "job:2")  # ended a half-life ago (its end: -59 min)
        used(ada, None, this_minute - 30 * hour, 600.0, "job:3")  # past the horizon
        used(bob, vision.id, this_minute, 180.0, "job:4")  # vision's: 3 devices this minute
        project_id = vision.id
    with session(engine) as s:
        by_key, by_project = recent_usage(s, now=this_minute + timedelta(seconds=60), half_life_s=3600.0)
    assert by_key[ada] == pytest.approx(120.0 + 60.0 * 0.5)
    assert by_key[bob] == pytest.approx(180.0)
    assert by_project == {project_id: pytest.approx(180.0)}  # keys of no project count for none
