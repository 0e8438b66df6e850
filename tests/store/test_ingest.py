"""Ingesting a real run directory: everything once, in order, and nothing from a half-written line."""

import json

import pytest
from sqlalchemy import select

from gpuforge.spec import parse_spec
from gpuforge.store.db import session
from gpuforge.store.ingest import ingest
from gpuforge.store.models import Event, Job
from gpuforge.train.engine import train
from tests.helpers.specs import image_spec


@pytest.fixture
def job_id(engine, tmp_path):
    train(parse_spec(image_spec(tmp_path, max_steps=4, checkpoint_every=2), tmp_path), tmp_path / "run")
    with session(engine) as s:
        job = Job(name="tiny", spec_yaml="", run_dir=str(tmp_path / "run"))
        s.add(job)
    return job.id


def _kinds(engine) -> list[str]:
    with session(engine) as s:
        return [e.kind for e in s.scalars(select(Event).order_by(Event.seq))]


def test_a_run_is_ingested_once_with_its_latest_figures(engine, job_id, tmp_path):
    with session(engine) as s:
        new = ingest(s, s.get(Job, job_id))
    assert [e.kind for e in new] == ["started", "checkpoint", "checkpoint", "finished"]
    with session(engine) as s:
        job = s.get(Job, job_id)
        assert ingest(s, job) == []  # nothing new: nothing stored twice
        last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
        assert (job.step, job.total_steps, job.loss) == (4, 4, last["loss"])
    assert _kinds(engine) == ["started", "checkpoint", "checkpoint", "finished"]


def test_a_half_written_line_waits_and_a_crash_mid_ingest_loses_nothing(engine, job_id, tmp_path):
    events = tmp_path / "run" / "events.jsonl"
    with session(engine) as s:
        ingest(s, s.get(Job, job_id))
    with events.open("a") as f:
        f.write('{"ts": 1.0, "event": "started", "step": 4')  # the writer was killed mid-line ... or is slow
    with session(engine) as s:
        assert ingest(s, s.get(Job, job_id)) == []
    with events.open("a") as f:
        f.write("}\n")
    with pytest.raises(RuntimeError), session(engine) as s:  # the server dies before its commit
        assert len(ingest(s, s.get(Job, job_id))) == 1
        raise RuntimeError("killed")
    with session(engine) as s:
        again = ingest(s, s.get(Job, job_id))
        assert [(e.seq, e.kind, e.data) for e in again] == [(4, "started", {"step": 4})]
    assert _kinds(engine) == ["started", "checkpoint", "checkpoint", "finished", "started"]
