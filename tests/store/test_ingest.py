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


# --- a job's files are untrusted input (issue 35) ---------------------------------------------------------
BAD_EVENTS = [
    b"[1, 2]",  # a list: pop() on it once stopped every tick
    b'{"ts": 1.0, "event": 5}',
    b'{"ts": NaN, "event": "x"}',
    b'{"ts": 1.0, "event": "x", "n": Infinity}',
    b'{"ts": 1.0, "event": "x", "n": ' + b"9" * 5000 + b"}",  # past Python's int digits: a ValueError
    b'{"ts": 1.0, "event": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than the parser
    b'{"ts": "yesterday", "event": "x"}',
    b'{"ts": 1.0, "event": "' + b"k" * 33 + b'"}',  # past Event.kind's column
    b'{"ts": 1.0, "event": "finished", "reason": {"a": 1}}',  # a reason that is no text
    b'{"ts": 1.0, "event": "started", "total_steps": 99999999999999}',  # past an integer column
    b'{"ts": 1.0, "event": "x", "s": "a\\u0000b"}',  # NUL: PostgreSQL takes no such text
    b'{"ts": 1.0, "event": "x", "s": "\\ud800"}',  # a lone surrogate: no UTF-8 for it
    b"\xff\xfe not utf-8",
]
BAD_METRICS = [b'{"step": 3, "mfu": 12345}', b'{"step": 3, "eta_s": -5}', b'{"step": -1}', b'{"step": 2.5}']


def test_every_kind_of_bad_line_is_an_unreadable_event_naming_its_file_and_line(engine, job_id, tmp_path):
    run = tmp_path / "run"
    with session(engine) as s:
        ingest(s, s.get(Job, job_id))
        lines = len((run / "events.jsonl").read_text().splitlines())
        job = s.get(Job, job_id)
        step, loss = job.step, job.loss
    with (run / "events.jsonl").open("ab") as f:
        f.write(b"\n".join(BAD_EVENTS) + b"\n" + b'{"ts": 2.0, "event": "checkpoint", "step": 9}\n')
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"\n".join(BAD_METRICS) + b"\n")
    with session(engine) as s:
        new = ingest(s, s.get(Job, job_id))
    unreadable = [e.data for e in new if e.kind == "unreadable"]
    told = [(d["file"], d["line"]) for d in unreadable if "line" in d]
    # ten a file a look, then one event that counts the rest
    assert told[:10] == [("events.jsonl", lines + i) for i in range(1, 11)]
    assert unreadable[10] == {"file": "events.jsonl", "lines": f"{lines + 11}-{lines + 13}", "count": 3}
    assert [e.kind for e in new if e.kind != "unreadable"] == ["checkpoint"]  # the good line after them
    metrics = [d for d in unreadable if d["file"] == "metrics.jsonl"]
    assert len(metrics) == len(BAD_METRICS) and all(d["why"] for d in metrics)
    assert "mfu" in metrics[0]["why"] and "eta_s" in metrics[1]["why"]
    with session(engine) as s:
        job = s.get(Job, job_id)
        assert (job.step, job.loss, job.total_steps) == (step, loss, 4)  # no bad figure taken


def test_a_link_or_a_fifo_is_refused_and_a_long_line_is_skipped_whole(engine, job_id, tmp_path):
    import os

    from gpuforge.store.ingest import MAX_LINE

    run = tmp_path / "run"
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"ts": 1.0, "event": "finished"}\n')
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").symlink_to(secret)
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")  # opening it to read would wait for a writer forever
    with session(engine) as s:
        new = ingest(s, s.get(Job, job_id))
    assert [(e.kind, e.data["file"], e.data["why"]) for e in new] == [
        ("unreadable", "events.jsonl", "a link, not a file gpuforge wrote"),
        ("unreadable", "metrics.jsonl", "not a plain file"),
    ]
    with session(engine) as s:
        assert ingest(s, s.get(Job, job_id)) == []  # told once, not at every look
    (run / "events.jsonl").unlink()
    (run / "metrics.jsonl").unlink()
    long = b'{"ts": 1.0, "event": "x", "pad": "' + b"a" * (MAX_LINE + 10)
    (run / "events.jsonl").write_bytes(long)  # still being written: skipped from here on
    with session(engine) as s:
        new = ingest(s, s.get(Job, job_id))
    assert [(e.kind, e.data["why"]) for e in new] == [("unreadable", f"a line over {MAX_LINE} bytes")]
    with (run / "events.jsonl").open("ab") as f:
        f.write(b"a" * 1000 + b'"}\n{"ts": 2.0, "event": "checkpoint"}\n')  # its end, then a good line
    with session(engine) as s:
        assert [e.kind for e in ingest(s, s.get(Job, job_id))] == ["checkpoint"]


def test_a_look_reads_at_most_its_limit_and_the_next_one_goes_on(engine, job_id, tmp_path, monkeypatch):
    from gpuforge.store import ingest as module

    monkeypatch.setattr(module, "READ_LIMIT", 64 * 1024)
    metrics = tmp_path / "run" / "metrics.jsonl"
    size = metrics.stat().st_size
    with metrics.open("a") as f:
        for step in range(5, 20_005):
            f.write(json.dumps({"step": step, "loss": 0.5}) + "\n")
    looks = []
    with session(engine) as s:
        job = s.get(Job, job_id)
        while job.metrics_offset < metrics.stat().st_size:
            before = job.metrics_offset
            ingest(s, job)
            looks.append(job.metrics_offset - before)
    assert max(looks) <= 64 * 1024 and len(looks) >= (metrics.stat().st_size - size) // (64 * 1024)
    with session(engine) as s:
        assert s.get(Job, job_id).step == 20_004  # the last line, once every look is done
