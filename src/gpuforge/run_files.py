"""Reading a run directory's append-only files while its runner writes them: lines past an offset, pages
of metrics, the tail of a log, and a run's metrics as downsampled series for charts.

Shared by the server (its routes and live streams) and `gpuforge dashboard` (run directories without a
server). A job's files are untrusted input: each is opened by runs.open_run_file (never through a link,
never a FIFO: such a file reads as absent here), read a bounded chunk at a time, and a line that is not a
JSON object is skipped. A line without its newline yet is left for the next read; a file shorter than the
offset read so far, or another file at the same path (the runner replaces metrics.jsonl when it trims it
on resume), is read again from the top.
"""

from __future__ import annotations

import json
import math
import os
import threading
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from gpuforge.runs import RunDir, finite_number, open_run_file, read_run_file

READ_CHUNK = 1 << 20  # a reader takes at most this much a call: a huge log never stalls the server
REPORT_LIMIT = 16 << 20  # a compression report is a few KiB


def _opened(path: Path) -> BinaryIO | None:
    """runs.open_run_file, with a file it refuses (a link, a FIFO) read as absent: a reader serves nothing
    of it."""
    try:
        return open_run_file(path)
    except OSError:
        return None


def read_lines(path: Path, offset: int, limit: int | None = None) -> tuple[list[bytes], int]:
    """Complete lines after byte `offset` (within `limit` bytes, READ_CHUNK by default), and the offset
    past the last one. A file shorter than `offset` was rewritten (the runner trims metrics on resume):
    start it again from the top."""
    f = _opened(path)
    if f is None:
        return [], offset
    with f:
        f.seek(0, 2)
        if f.tell() < offset:
            offset = 0
        f.seek(offset)
        chunk = f.read(READ_CHUNK if limit is None else limit)
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].split(b"\n")[:-1], offset + end


def json_line(line: bytes) -> dict[str, Any] | None:
    """One JSON object line; None for a torn line from a killed writer, or anything not an object."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # torn, huge integers, nested too deep
        return None
    return value if isinstance(value, dict) else None


def metrics_page(path: Path, after_step: int, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` metrics records whose step is past `after_step`, in step order; the file is read a
    chunk at a time, and no further than the page needs."""
    records, offset = [], 0
    while True:
        lines, end = read_lines(path, offset, READ_CHUNK)
        for line in lines:
            record = json_line(line)
            if record is not None and record.get("step", 0) > after_step:
                records.append(record)
                if len(records) == limit:
                    return records
        if end == offset or not lines:  # the end of the file, or a line longer than a chunk: stop there
            return records
        offset = end


def small_text(path: Path, limit: int) -> str | None:
    """A small file the runner wrote, whole, as text (runs.read_run_file: never through a link, a FIFO, or
    past `limit` bytes; OSError naming the file and why)."""
    try:
        raw = read_run_file(path, limit)
    except OSError as err:
        raise OSError(f"{path.name}: {err}") from None
    return raw.decode(errors="replace") if raw is not None else None


def log_tail(path: Path, lines: int) -> tuple[list[str], int]:
    """The last `lines` complete lines of a log (read from its end, at most ~1 KiB a line), and the byte
    offset to follow it from."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], 0
    start = max(0, size - max(lines, 1) * 1024)
    found, end = read_lines(path, start, max(1, size - start))
    if start > 0:
        found = found[1:]  # the first one is likely cut
    return [line.decode(errors="replace").rstrip() for line in found[-lines:]] if lines else [], end


def last_record(path: Path) -> dict[str, Any] | None:
    """The last whole JSON line of a file (read from its end): a run's latest metrics record."""
    f = _opened(path)
    if f is None:
        return None
    with f:
        size = f.seek(0, 2)
        f.seek(max(0, size - 16 * 1024))
        tail = f.read()
    for line in reversed(tail[: tail.rfind(b"\n") + 1].split(b"\n")):
        if line.strip() and (record := json_line(line)) is not None:
            return record
    return None


def events_page(path: Path, after: int, limit: int) -> list[dict[str, Any]]:
    """events.jsonl as the server's event records ({seq, ts, kind, data}), seq being the line number."""
    found, seq, offset = [], -1, 0
    while True:  # a chunk at a time: the file may be as large as its job made it
        lines, end = read_lines(path, offset)
        for line in lines:
            seq += 1
            record = json_line(line)
            if seq <= after or record is None:
                continue
            kind, ts = str(record.pop("event", "unknown")), record.pop("ts", 0.0)
            found.append({"seq": seq, "ts": float(ts) if isinstance(ts, int | float) else 0.0, "kind": kind})
            found[-1]["data"] = record
            if len(found) == limit:
                return found
        if end == offset or not lines:
            return found
        offset = end


def read_report(run_dir: Path) -> dict[str, Any] | None:
    """The run's compression report (report.json of its compressed/ folder); None where there is none,
    or where it is torn."""
    try:
        raw = read_run_file(RunDir(run_dir).compressed_dir / "report.json", REPORT_LIMIT)
        report = json.loads(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return None
    return report if isinstance(report, dict) else None


LR_FIND_LIMIT = 256 << 10  # the range test's record is a few KiB
LR_FIND_POINTS = 1000


def read_lr_find(run_dir: Path) -> dict[str, Any] | None:
    """train.lr auto's lr_find.json, checked (the job's own file): the pick, the rule, and the curve as
    [lr, loss] points of finite numbers only (a step whose loss was not finite left out); None where
    there is none or it is not one."""
    try:
        raw = read_run_file(RunDir(run_dir).lr_find_path, LR_FIND_LIMIT)
        record = json.loads(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not _positive_number(record.get("lr")):
        return None
    lrs, losses = record.get("lrs"), record.get("losses")
    if not isinstance(lrs, list) or not isinstance(losses, list):
        return None
    points = [
        [float(lr), float(loss)]
        for lr, loss in zip(lrs[:LR_FIND_POINTS], losses[:LR_FIND_POINTS], strict=False)
        if _positive_number(lr) and finite_number(loss)
    ]
    seconds = record.get("seconds")
    return {
        "lr": float(record["lr"]),
        "rule": str(record.get("rule", ""))[:200],
        "reason": str(record.get("reason", ""))[:300],
        "points": points,
        "seconds": float(seconds) if finite_number(seconds) else None,
    }


def _positive_number(value: Any) -> bool:
    return finite_number(value) and value > 0


NOT_METRICS = ("step", "ts")  # a metrics line's step and the time it was written: its axes, not figures


class _Columns:
    """A metrics file read so far: each numeric metric as (steps, values) in compact arrays (8 bytes a
    number, not a Python float's 24 and its pointer), and where reading stopped. Its own lock: a long
    first read of one run holds up no other run's."""

    def __init__(self, identity: tuple[int, int]):
        self.identity, self.offset, self.records = identity, 0, 0
        self.metrics: dict[str, tuple[array, array]] = {}
        self.lock = threading.Lock()

    def add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        self.records += 1
        for name, value in record.items():
            if name in NOT_METRICS or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):
                continue
            steps, values = self.metrics.setdefault(name, (array("q"), array("d")))
            steps.append(step)
            values.append(float(value))

    def read_on(self, f) -> None:
        """Read the open file `f` from where reading stopped, a chunk at a time, to its last whole line."""
        while True:
            f.seek(self.offset)
            chunk = f.read(READ_CHUNK)
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                return  # nothing new, or a line longer than a chunk (left alone, as metrics_page does)
            for line in chunk[:end].split(b"\n")[:-1]:
                if (record := json_line(line)) is not None:
                    self.add(record)
            self.offset += end


_CACHE_SIZE = 16  # runs whose columns stay parsed: a page polled every 2 s reads only what was appended
_cache: OrderedDict[Path, _Columns] = OrderedDict()
_cache_lock = threading.Lock()  # the table alone; each entry has its own


def series(path: Path, max_points: int) -> dict[str, Any]:
    """The metrics file as one series a metric ({step: [...], value: [...]}), each at most `max_points`
    long: past that, the steps are cut into buckets and each keeps its min and its max (in step order),
    so that a spike is never averaged away."""
    f = _opened(path)
    if f is None:
        return {"records": 0, "metrics": {}}
    with f:
        stat = os.fstat(f.fileno())  # the file read below, even if the runner replaces the path meanwhile
        identity = (stat.st_dev, stat.st_ino)
        with _cache_lock:
            columns = _cache.get(path)
            if columns is None or columns.identity != identity or stat.st_size < columns.offset:
                columns = _Columns(identity)  # new, or replaced by a trim: from the top
                _cache[path] = columns
            _cache.move_to_end(path)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        with columns.lock:
            columns.read_on(f)
            return {
                "records": columns.records,
                "metrics": {
                    name: downsample(steps, values, max_points)
                    for name, (steps, values) in columns.metrics.items()
                },
            }


def downsample(steps, values, max_points: int) -> dict[str, list]:
    """At most `max_points` points of (steps, values): the first and the last, and between them the min
    and the max of each of (max_points - 2) / 2 buckets, in step order."""
    n = len(steps)
    if n <= max_points:
        return {"step": list(steps), "value": list(values)}
    import numpy as np  # here: only a long run's chart pays for it

    v = np.asarray(values, dtype=np.float64)
    buckets = max(1, (max_points - 2) // 2)
    edges = 1 + (np.arange(buckets + 1) * (n - 2)) // buckets
    kept = {0, n - 1}
    for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        if lo < hi:
            window = v[lo:hi]
            kept.update((lo + int(window.argmin()), lo + int(window.argmax())))
    order = sorted(kept)
    return {"step": [steps[i] for i in order], "value": [values[i] for i in order]}
