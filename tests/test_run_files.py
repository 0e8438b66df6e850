"""Reading run files while they are written: downsampled series (min and max kept, the span kept, a
replaced file read afresh), the last record, events as the server stores them."""

import json
import os

from gpuforge.run_files import downsample, events_page, last_record, series, small_text


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_downsampling_keeps_the_span_and_each_buckets_extremes():
    steps = list(range(1, 10_001))
    values = [float((i * 7919) % 1000) for i in steps]
    values[5000] = 1e6  # one spike: an average would hide it
    out = downsample(steps, values, 100)
    assert len(out["step"]) <= 100 and out["step"] == sorted(out["step"])
    assert out["step"][0] == 1 and out["step"][-1] == 10_000
    assert 1e6 in out["value"] and min(values) in out["value"]
    assert downsample([1, 2, 3], [1.0, 2.0, 3.0], 100) == {"step": [1, 2, 3], "value": [1.0, 2.0, 3.0]}


def test_series_reads_what_was_appended_and_a_replaced_file_afresh(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": s, "loss": 1.0 / s, "tokens_per_s": None} for s in range(1, 6)])
    first = series(path, 1000)
    assert first["records"] == 5 and first["metrics"]["loss"]["step"] == [1, 2, 3, 4, 5]
    assert "tokens_per_s" not in first["metrics"]  # nulls are not points
    with path.open("a") as f:
        f.write(json.dumps({"step": 6, "loss": 0.1}) + "\n" + '{"step": 7, "lo')  # the last line unfinished
    assert series(path, 1000)["metrics"]["loss"]["step"] == [1, 2, 3, 4, 5, 6]
    # the runner trims on resume by writing a new file in place of the old one (os.replace)
    trimmed = tmp_path / "trimmed.jsonl"
    _write(trimmed, [{"step": s, "loss": 2.0} for s in range(1, 4)])
    os.replace(trimmed, path)
    again = series(path, 1000)
    assert again["records"] == 3 and again["metrics"]["loss"]["value"] == [2.0, 2.0, 2.0]
    assert series(tmp_path / "none.jsonl", 1000) == {"records": 0, "metrics": {}}


def test_the_last_record_and_events(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"step": 1, "peak_mem_bytes": 10}, {"step": 2, "peak_mem_bytes": 20}])
    with metrics.open("a") as f:
        f.write('{"step": 3, "pe')  # being written
    assert last_record(metrics) == {"step": 2, "peak_mem_bytes": 20}
    assert last_record(tmp_path / "none") is None
    events = tmp_path / "events.jsonl"
    _write(events, [{"ts": 1.5, "event": "started", "step": 0}, {"ts": 2.5, "event": "finished", "step": 3}])
    assert events_page(events, -1, 10) == [
        {"seq": 0, "ts": 1.5, "kind": "started", "data": {"step": 0}},
        {"seq": 1, "ts": 2.5, "kind": "finished", "data": {"step": 3}},
    ]
    assert [e["seq"] for e in events_page(events, 0, 10)] == [1]


def test_a_small_file_is_read_whole_and_never_through_a_link_a_fifo_or_past_its_limit(tmp_path):
    import pytest

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "script.sh").write_text("#!/bin/bash\n")
    assert small_text(logs / "script.sh", 100) == "#!/bin/bash\n"
    assert small_text(logs / "missing.sh", 100) is None
    (tmp_path / "secret").write_text("not the run's")
    (logs / "linked.sh").symlink_to(tmp_path / "secret")
    os.mkfifo(logs / "pipe.sh")  # opened blocking, it would hang the server's thread for ever
    (logs / "big.sh").write_text("x" * 101)
    for name, why in (("linked.sh", "a link"), ("pipe.sh", "not a plain file"), ("big.sh", "over 100 bytes")):
        with pytest.raises(OSError, match=why):
            small_text(logs / name, 100)
    (tmp_path / "other").symlink_to(logs)  # a run whose logs/ is a link into another run's
    with pytest.raises(OSError, match="a link, not a folder"):
        small_text(tmp_path / "other" / "script.sh", 100)


def test_every_reader_serves_nothing_through_a_link_or_a_fifo_and_skips_lines_it_cannot_hold(tmp_path):
    """Issue 35: the logs, metrics, series and report readers followed a link in the run directory; each
    now opens a run's files as runs.open_run_file does, and a line of huge integers or deep nesting is
    skipped rather than raised."""
    from gpuforge.run_files import log_tail, metrics_page, read_report

    secret = tmp_path / "secret"
    secret.mkdir()
    _write(secret / "metrics.jsonl", [{"step": 1, "loss": 0.5}])
    (secret / "process.log").write_text("the server's own secrets\n")
    (secret / "report.json").write_text('{"variants": []}')
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").symlink_to(secret / "metrics.jsonl")
    (run / "events.jsonl").symlink_to(secret / "metrics.jsonl")
    (run / "logs" / "process.log").symlink_to(secret / "process.log")
    (run / "compressed").symlink_to(secret)  # a linked folder
    assert metrics_page(run / "metrics.jsonl", 0, 10) == []
    assert series(run / "metrics.jsonl", 100) == {"records": 0, "metrics": {}}
    assert last_record(run / "metrics.jsonl") is None and events_page(run / "events.jsonl", -1, 10) == []
    assert log_tail(run / "logs" / "process.log", 10)[0] == []
    assert read_report(run) is None
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    assert metrics_page(fifo, 0, 10) == [] and last_record(fifo) is None

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b'{"step": ' + b"9" * 5000 + b"}\n" + b"[" * 100_000 + b"\n" + b'{"step": 2, "loss": 1.0}\n'
    )
    assert metrics_page(bad, 0, 10) == [{"step": 2, "loss": 1.0}]
    assert series(bad, 100)["records"] == 1
