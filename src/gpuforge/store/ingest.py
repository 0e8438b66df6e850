"""Copy what a run directory gained since the last look into the store: new events, latest figures.

The runner writes only its run directory (DESIGN); the server reads it. Each job remembers how far it
read events.jsonl and metrics.jsonl (bytes, and lines for the line numbers its messages give), and that
position is committed in the same transaction as the events it covers: a server killed mid-ingest either
stored a line and moved past it, or did neither, so nothing is lost or stored twice. A line still being
written (no newline yet) waits for the next look.

A job's files are untrusted input: whatever a job writes there, the loop goes on for every job. A file is
read without following a link, never when it is not a plain file (a FIFO would hang the reader), at most
READ_LIMIT bytes a look (the rest waits for the next one); a line over MAX_LINE is skipped whole, and so is
one that is not a JSON object, holds NaN, Infinity, a number past what JSON parsers agree on, or a key of
the wrong type: each becomes an `unreadable` event naming the file and its line (at most
UNREADABLE_PER_LOOK a file a look, then one event that counts the rest). The figures the server shows from
metrics are the job's own report (loss, MFU, ETA: range-checked); what the server measures itself (cost,
device time, state) is never taken from a job's files.

A runner refused its input (exit 2: a spec or data error) writes no event: its one-line error is the last
`gpuforge: error:` line of <run>/logs/process.log (cli.py main), which `bad_input_error` reads back.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.orm import Session

from gpuforge.runs import open_run_file
from gpuforge.store.models import Event, Job

ERROR_PREFIX = "gpuforge: error: "  # what cli.py main() prints before exit 2
LOG_TAIL_BYTES = 64 * 2**10  # the error line is among the log's last ones: never read a whole log
READ_LIMIT = 4 * 2**20  # bytes of one file a look: a job cannot make a tick hold more of it
MAX_LINE = 256 * 2**10  # a runner's lines are a few hundred bytes; a longer one is skipped whole
UNREADABLE_PER_LOOK = 10  # unreadable events a file a look; past it, one event counts the rest
MAX_KIND = 32  # Event.kind's column
MAX_REASON = 4000  # characters of an ending's reason kept
REFUSED = -1  # a file's offset once it was refused (a link, a FIFO) and said so
INT_LIMIT = 2**31 - 1  # integer columns (step, total_steps) hold no more on PostgreSQL
# the metrics figures the store keeps (Job columns), each with what a value must be to be shown
FIGURES: dict[str, tuple[type, float, float]] = {
    "step": (int, 0, INT_LIMIT),
    "loss": (float, -math.inf, math.inf),
    "samples_per_s": (float, 0, math.inf),
    "mfu": (float, 0, 1),  # a fraction of the device's measured peak
    "eta_s": (float, 0, math.inf),
}
# the events that say how many steps a job has: the engine's `started`, a script's track.total_steps()
TOTAL_EVENTS = ("started", "total_steps")


@dataclass
class _Read:
    """What one look at a file found: its complete lines (line number, record, or why it is unreadable),
    and where the next look starts."""

    lines: list[tuple[int, dict[str, Any] | str]] = field(default_factory=list)
    offset: int = 0
    line_count: int = 0  # lines read in all, this look's included
    refused: str | None = None  # the file itself cannot be read (a link, not a plain file)


def _open_plain(path: Path) -> tuple[BinaryIO | None, str | None]:
    """(the open file, None), (None, None) where there is none, or (None, why) where runs.open_run_file
    refuses it (a link, a linked folder, not a plain file)."""
    try:
        return open_run_file(path), None
    except OSError as err:
        return None, str(err)


def read_new_lines(path: Path, offset: int, lines_before: int) -> _Read:
    """The complete lines after byte `offset` (at most READ_LIMIT bytes of them), each parsed (`record`)
    or said unreadable; a file shorter than `offset` was rewritten (the runner trims metrics on resume)
    and is read again from the top."""
    f, refused = _open_plain(path)
    if f is None:
        if refused is None:
            return _Read(offset=offset, line_count=lines_before)
        # said once (its offset marks it told): a link left in place must not add an event every tick
        return _Read(offset=REFUSED, line_count=lines_before, refused=None if offset == REFUSED else refused)
    offset = 0 if offset == REFUSED else offset  # a plain file again: read from the top
    with f:
        if os.fstat(f.fileno()).st_size < offset:
            offset, lines_before = 0, 0
        start = max(0, offset - 1)  # the byte before: a newline, unless a long line is being skipped
        f.seek(start)
        chunk = f.read(READ_LIMIT + offset - start)
    skipping = offset > 0 and chunk[:1] != b"\n"
    chunk = chunk[offset - start :]
    read = _Read(offset=offset, line_count=lines_before)
    at = 0
    if skipping:  # the rest of a line too long, reported when its skip began
        newline = chunk.find(b"\n")
        if newline < 0:
            read.offset += len(chunk)
            return read
        at = newline + 1
    while (newline := chunk.find(b"\n", at)) >= 0:
        read.line_count += 1
        line = chunk[at:newline]
        if line.strip():
            read.lines.append((read.line_count, record(line)))
        at = newline + 1
    if len(chunk) - at > MAX_LINE:  # a line still growing past the limit: skipped from here on
        read.line_count += 1
        read.lines.append((read.line_count, f"a line over {MAX_LINE} bytes"))
        at = len(chunk)
    read.offset += at
    return read


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def record(line: bytes) -> dict[str, Any] | str:
    """One line as a JSON object, or why it is not one a store can keep: over MAX_LINE, not JSON (a torn
    line from a killed writer), NaN or Infinity, an integer of more digits than Python parses, nesting
    deeper than the parser goes, not an object, or text no database takes (NUL, lone surrogates)."""
    if len(line) > MAX_LINE:
        return f"a line over {MAX_LINE} bytes"
    try:
        value = json.loads(line, parse_constant=_no_constant)
    except RecursionError:
        return "nested too deep"
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError and int digits are ValueErrors
        return f"not JSON ({str(err)[:100]})"
    if not isinstance(value, dict):
        return f"not a JSON object but {type(value).__name__}"
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")
    except (ValueError, RecursionError, UnicodeEncodeError):
        return "text no database takes (lone surrogates)"
    if "\\u0000" in text:  # json.dumps escapes NUL so
        return "a NUL character, which no database takes"
    return value


def _number(value: Any, kind: type, low: float, high: float) -> float | int | None:
    """`value` as a figure of `kind` within [low, high], or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if kind is int and not isinstance(value, int):
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return value if kind is int else float(value)


def _event(record: dict[str, Any]) -> tuple[str, float, dict[str, Any]] | str:
    """(kind, ts, data) of an events line, or why it is unreadable."""
    kind = record.pop("event", "unknown")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        return f"`event` is not a name of at most {MAX_KIND} characters"
    ts = _number(record.pop("ts", 0.0), float, 0, 1e11)
    if ts is None:
        return "`ts` is not a time in seconds"
    reason = record.get("reason")
    if reason is not None and not isinstance(reason, str):
        return "`reason` is not text"
    if reason is not None:
        record["reason"] = reason[:MAX_REASON]
    if kind in TOTAL_EVENTS and "total_steps" in record:
        if record["total_steps"] is not None and _number(record["total_steps"], int, 1, INT_LIMIT) is None:
            return "`total_steps` is not a count of steps"
    return kind, ts, record


def _figures(record: dict[str, Any]) -> dict[str, float | int] | str:
    """The figures of a metrics line that the store keeps, or why the line is unreadable."""
    found = {}
    for key, (kind, low, high) in FIGURES.items():
        if record.get(key) is None:
            continue
        value = _number(record[key], kind, low, high)
        if value is None:
            return f"`{key}` is not a {kind.__name__} in [{low:g}, {high:g}]"
        found[key] = value
    return found


class _Unreadable:
    """The unreadable events of one file in one look: the first UNREADABLE_PER_LOOK each, then a count."""

    def __init__(self, job: Job, name: str, ts: float):
        self.job, self.name, self.ts = job, name, ts
        self.told: list[Event] = []
        self.more: list[int] = []  # line numbers past the limit

    def add(self, line_number: int, why: str) -> None:
        if len(self.told) < UNREADABLE_PER_LOOK:
            data = {"file": self.name, "line": line_number, "why": why}
            self.told.append(_new_event(self.job, self.ts, "unreadable", data))
        else:
            self.more.append(line_number)

    def events(self) -> list[Event]:
        if not self.more:
            return self.told
        data = {"file": self.name, "lines": f"{self.more[0]}-{self.more[-1]}", "count": len(self.more)}
        return [*self.told, _new_event(self.job, self.ts, "unreadable", data)]


def _new_event(job: Job, ts: float, kind: str, data: dict[str, Any]) -> Event:
    event = Event(job_id=job.id, seq=job.events_read, ts=ts, kind=kind, data=data)
    job.events_read += 1
    return event


def ingest(s: Session, job: Job) -> list[Event]:
    """Store the job's new events and its latest metrics figures (in `s`, committed by the caller); the
    events stored, `unreadable` ones included (dated by the server's clock)."""
    run, now = Path(job.run_dir), time.time()
    new: list[Event] = []
    events = read_new_lines(run / "events.jsonl", job.events_offset, job.events_lines)
    unreadable = _Unreadable(job, "events.jsonl", now)
    if events.refused:
        unreadable.add(job.events_lines + 1, events.refused)
    for number, line in events.lines:
        found = _event(line) if isinstance(line, dict) else line
        if isinstance(found, str):
            unreadable.add(number, found)
            continue
        kind, ts, data = found
        new.append(_new_event(job, ts, kind, data))
        if kind in TOTAL_EVENTS and data.get("total_steps"):
            job.total_steps = data["total_steps"]
    new += unreadable.events()
    job.events_offset, job.events_lines = events.offset, events.line_count
    s.add_all(new)  # with the position that covers them

    metrics = read_new_lines(run / "metrics.jsonl", job.metrics_offset, job.metrics_lines)
    unreadable = _Unreadable(job, "metrics.jsonl", now)
    if metrics.refused:
        unreadable.add(job.metrics_lines + 1, metrics.refused)
    # each figure's last value: a script may log its loss and its eval on lines of their own, and a line
    # without a loss must not leave an older line's loss standing for this look's last step
    latest: dict[str, float | int] = {}
    for number, line in metrics.lines:
        figures = _figures(line) if isinstance(line, dict) else line
        if isinstance(figures, str):
            unreadable.add(number, figures)
        else:
            latest.update(figures)
    for key, value in latest.items():
        setattr(job, key, value)
    told = unreadable.events()
    job.metrics_offset, job.metrics_lines = metrics.offset, metrics.line_count
    s.add_all(told)
    return new + told


def bad_input_error(run_dir: str, files: dict[str, str] | None, last_line_only: bool = False) -> str | None:
    """The message of the last `gpuforge: error:` line of the run's process log, with the job's uploads
    named as the user knows them; None when there is none. `last_line_only`: only when it is the log's
    last line (a process re-attached after a server restart, whose exit code nobody has: a runner that
    printed it has ended on it)."""
    f, _ = _open_plain(Path(run_dir) / "logs" / "process.log")
    if f is None:
        return None
    with f:
        f.seek(max(0, f.seek(0, 2) - LOG_TAIL_BYTES))
        lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    if last_line_only:
        lines = lines[-1:]
    found = next((line for line in reversed(lines) if line.startswith(ERROR_PREFIX)), None)
    return in_users_names(found[len(ERROR_PREFIX) :].strip(), files) if found else None


def in_users_names(text: str, files: dict[str, str] | None) -> str:
    """`text` with each uploaded file's server path replaced by the name the user's client gave it."""
    for server_path, users_name in sorted((files or {}).items(), key=lambda f: -len(f[0])):  # longest first
        text = text.replace(server_path, users_name)
    return text
