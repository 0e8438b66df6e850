"""Copy what a run directory gained since the last look into the store: new events, latest figures.

The runner writes only its run directory (DESIGN); the server reads it. Each job remembers how far it
read events.jsonl and metrics.jsonl (bytes, and lines for the events' numbers), and that position is
committed in the same transaction as the events it covers: a server killed mid-ingest either stored a
line and moved past it, or did neither, so nothing is lost or stored twice. A line still being written
(no newline yet) waits for the next look.

A runner refused its input (exit 2: a spec or data error) writes no event: its one-line error is the last
`gpuforge: error:` line of <run>/logs/process.log (cli.py main), which `bad_input_error` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from gpuforge.store.models import Event, Job

ERROR_PREFIX = "gpuforge: error: "  # what cli.py main() prints before exit 2
LOG_TAIL_BYTES = 64 * 2**10  # the error line is among the log's last ones: never read a whole log
FIGURES = ("step", "loss", "samples_per_s", "cost_usd", "mfu", "eta_s")  # metrics keys = Job columns


def _new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines after `offset`, and the offset after the last complete one."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1  # 0 when no line is complete yet
    records = []
    for line in chunk[:end].splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a torn line from a killed writer: skipped, never fatal
                records.append({"event": "unreadable", "line": line[:200].decode(errors="replace")})
    return records, offset + end


def ingest(s: Session, job: Job) -> list[Event]:
    """Store the job's new events and its latest metrics figures (in `s`, committed by the caller)."""
    run = Path(job.run_dir)
    records, job.events_offset = _new_lines(run / "events.jsonl", job.events_offset)
    new = []
    for record in records:
        kind = str(record.pop("event", "unknown"))
        ts = float(record.pop("ts", 0.0))
        new.append(Event(job_id=job.id, seq=job.events_read, ts=ts, kind=kind, data=record))
        job.events_read += 1
    s.add_all(new)
    metrics, job.metrics_offset = _new_lines(run / "metrics.jsonl", job.metrics_offset)
    if metrics:
        latest = metrics[-1]
        for key in FIGURES:
            if latest.get(key) is not None:
                setattr(job, key, latest[key])
    for event in new:
        if event.kind == "started" and event.data.get("total_steps"):
            job.total_steps = event.data["total_steps"]
    return new


def bad_input_error(run_dir: str, files: dict[str, str] | None, last_line_only: bool = False) -> str | None:
    """The message of the last `gpuforge: error:` line of the run's process log, with the job's uploads
    named as the user knows them; None when there is none. `last_line_only`: only when it is the log's
    last line (a process re-attached after a server restart, whose exit code nobody has: a runner that
    printed it has ended on it)."""
    try:
        with (Path(run_dir) / "logs" / "process.log").open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - LOG_TAIL_BYTES))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    if last_line_only:
        lines = lines[-1:]
    found = next((line for line in reversed(lines) if line.startswith(ERROR_PREFIX)), None)
    return in_users_names(found[len(ERROR_PREFIX) :].strip(), files) if found else None


def in_users_names(text: str, files: dict[str, str] | None) -> str:
    """`text` with each uploaded file's server path replaced by the name the user's client gave it."""
    for server_path, users_name in sorted((files or {}).items(), key=lambda f: -len(f[0])):  # longest first
        text = text.replace(server_path, users_name)
    return text
