"""Live streams of a run directory while its runner writes it (the reading itself: run_files.py).

Metrics and logs are served from the run directory itself (the runner's own record, DESIGN), not from
the store: the runner already drops metrics lines a killed process logged past its checkpoint, so what
the file holds is each step once. A line without its newline yet is left for the next read.

Streams are server-sent events (text/event-stream): `event: metric` (one metrics.jsonl record),
`event: log` ({"line", "offset"}), and a last `event: end` ({"state", "reason"}) once the job has
stopped (finished, failed, cancelled, paused) and everything it wrote was sent, or at once with state
`revoked` when the key that opened the stream is revoked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from gpuforge.run_files import READ_CHUNK, json_line, read_lines
from gpuforge.store.models import ENDED_JOB_STATES, JobState

POLL_S = 0.25
KEEPALIVE_S = 15.0
STOPPED = (*ENDED_JOB_STATES, JobState.PAUSED)  # a stream ends with its job, or its budget
REVOKED = "revoked"  # the stream's key was revoked: it ends now, whatever its job does


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def follow(
    run_dir: Path,
    job_state: Callable[[], tuple[str, str | None]],
    *,
    after_step: int | None = None,
    log_offset: int | None = None,
) -> AsyncIterator[str]:
    """Server-sent events for a job's metrics (when `after_step` is given) and log (when `log_offset`
    is given) as they are written, until the job stops. `job_state` reads (state, reason) from the store
    and is called in a worker thread."""
    metrics_path, log_path = run_dir / "metrics.jsonl", run_dir / "logs" / "process.log"
    metrics_offset, quiet_since = 0, time.monotonic()
    while True:
        state, reason = await asyncio.to_thread(job_state)  # asked first: what follows covers all it wrote
        if state == REVOKED:
            yield sse("end", {"state": state, "reason": reason})
            return
        sent = False
        if after_step is not None:
            lines, metrics_offset = await asyncio.to_thread(
                read_lines, metrics_path, metrics_offset, READ_CHUNK
            )
            for line in lines:
                record = json_line(line)
                if record is not None and record.get("step", 0) > after_step:
                    after_step = record["step"]
                    sent = True
                    yield sse("metric", record)
        if log_offset is not None:
            lines, end = await asyncio.to_thread(read_lines, log_path, log_offset, READ_CHUNK)
            log_offset = end - sum(len(line) + 1 for line in lines)  # where the first line starts
            for line in lines:
                log_offset += len(line) + 1
                sent = True
                yield sse("log", {"line": line.decode(errors="replace").rstrip(), "offset": log_offset})
        if state in STOPPED and not sent:
            yield sse("end", {"state": state, "reason": reason})
            return
        if sent:
            quiet_since = time.monotonic()
            continue
        if time.monotonic() - quiet_since > KEEPALIVE_S:
            quiet_since = time.monotonic()
            yield ": keep-alive\n\n"  # a comment line: keeps proxies from closing an idle stream
        await asyncio.sleep(POLL_S)
