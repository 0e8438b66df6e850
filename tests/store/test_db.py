"""The store on SQLite and PostgreSQL: migrations make the models' schema, events are stored once."""

from datetime import UTC

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text
from sqlalchemy.exc import IntegrityError

from gpuforge.store.db import migrate, session
from gpuforge.store.models import Base, Event, Job


def _job(**fields) -> Job:
    return Job(name="j", spec_yaml="name: j\n", run_dir="/tmp/runs/j", **fields)


def test_the_migrations_build_exactly_the_models_schema_and_run_twice_safely(engine):
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        if engine.dialect.name == "sqlite":  # the pragmas connect() sets on SQLite (and on nothing else)
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0014"
    migrate(engine)  # already at head: nothing to do, nothing lost
    assert {"jobs", "events", "devices", "api_keys", "deployments"} <= set(inspect(engine).get_table_names())


def test_a_job_keeps_its_events_in_order_and_one_line_is_stored_once(engine):
    with session(engine) as s:
        job = _job(priority=3)
        s.add(job)
        s.flush()
        s.add_all(
            [Event(job_id=job.id, seq=i, ts=float(i), kind=k) for i, k in enumerate(["started", "finished"])]
        )
    with session(engine) as s:
        stored = s.scalars(select(Job)).one()
        assert stored.state == "queued" and stored.created_at.tzinfo is not None
        assert [e.kind for e in stored.events] == ["started", "finished"]
    with pytest.raises(IntegrityError), session(engine) as s:
        s.add(Event(job_id=stored.id, seq=1, ts=9.0, kind="finished"))  # the same line ingested again
    with session(engine) as s:
        assert len(s.scalars(select(Event)).all()) == 2  # the failed write changed nothing


def test_deleting_a_job_deletes_its_events(engine):
    with session(engine) as s:
        job = _job()
        s.add(job)
        s.flush()
        s.add(Event(job_id=job.id, seq=0, ts=0.0, kind="started", data={"step": 0}))
    with session(engine) as s:
        s.delete(s.scalars(select(Job)).one())
    with session(engine) as s:
        assert s.scalars(select(Event)).all() == []


def test_times_come_back_in_utc_whatever_the_servers_time_zone(engine):
    if engine.dialect.name == "postgresql":  # a server whose TimeZone is not UTC hands back its own zone
        with engine.connect() as conn:
            conn.execute(text(f"ALTER DATABASE \"{engine.url.database}\" SET timezone TO 'Asia/Tokyo'"))
            conn.commit()
        engine.dispose()  # new connections pick the setting up
    with session(engine) as s:
        s.add(_job())
    with session(engine) as s:
        assert s.scalars(select(Job)).one().created_at.tzinfo is UTC


def test_an_idempotency_key_names_one_job_of_its_owner(engine):
    from gpuforge.store.models import ApiKey

    with session(engine) as s:
        s.add_all([ApiKey(name="a", digest="a" * 64), ApiKey(name="b", digest="b" * 64)])
        s.flush()
        s.add_all([_job(owner_id=1, idempotency_key="k"), _job(owner_id=2, idempotency_key="k")])
        s.add_all([_job(owner_id=1), _job(owner_id=1)])  # no key: never in the way of each other
    with pytest.raises(IntegrityError), session(engine) as s:
        s.add(_job(owner_id=1, idempotency_key="k"))
    with session(engine) as s:
        assert len(s.scalars(select(Job)).all()) == 4


def test_an_older_stores_uploads_are_held_by_the_project_of_the_key_that_sent_them(engine):
    """Migration 0009: each stored upload's grant goes to its key's project, or to the key without one."""
    from alembic import command

    from gpuforge.store.db import alembic_config
    from gpuforge.store.models import ApiKey, Project, Upload, UploadGrant

    with session(engine) as s:
        project = Project(name="vision")
        s.add(project)
        s.flush()
        ada = ApiKey(name="ada", digest="a" * 64, project_id=project.id)
        bob = ApiKey(name="bob", digest="b" * 64)
        s.add_all([ada, bob])
        s.flush()
        s.add_all([Upload(sha256="1" * 64, suffix=".csv", key_id=ada.id, size=3),
                   Upload(sha256="2" * 64, suffix="", key_id=bob.id, size=4)])  # fmt: skip
        ids = (project.id, bob.id)
    command.downgrade(alembic_config(engine), "0008")
    migrate(engine)
    with session(engine) as s:
        held = {(g.sha256[0], g.suffix, g.holder) for g in s.scalars(select(UploadGrant))}
    assert held == {("1", ".csv", f"project:{ids[0]}"), ("2", "", f"key:{ids[1]}")}
