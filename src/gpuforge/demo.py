"""`gpuforge demo`: start a server on loopback, submit every shipped example to it, follow each to its
end (live metrics lines), and print one table of what they did. `--local` trains them in this process
instead, with no server.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuforge.server.local import LocalServer
from gpuforge.spec import load_spec

PRINT_EVERY_S = 2.0  # a metrics line per job at most this often: the log stays readable


def demo_via_server(specs: list[Path], home: Path, overrides: list[str], console: Console) -> Table:
    console.print(f"starting a gpuforge server (GPUFORGE_HOME={home}, log {home / 'server.log'})")
    with LocalServer(home, log=home / "server.log") as server:
        client = server.client()
        ids = []
        for spec_path in specs:
            job = client.submit(load_spec(spec_path, overrides))
            ids.append(job["id"])
            console.print(f"submitted {spec_path.name}: job {job['id']}", highlight=False)
        for job_id in ids:
            _follow(client, job_id, console)
        jobs = [client.job(i) for i in ids]
        table = _table([(job, _summary(client, job["id"])) for job in jobs])
    for job in jobs:
        console.print(f"job {job['id']} {job['name']}: {job['run_dir']}", soft_wrap=True, highlight=False)
    console.print(f"the server stopped; its store and runs stay in {home}", soft_wrap=True, highlight=False)
    return table


def _follow(client, job_id: int, console: Console) -> None:
    name = client.job(job_id)["name"]
    last = 0.0
    for event, data in client.follow(job_id, offset=0, metrics=True):
        if event == "metric" and time.monotonic() - last >= PRINT_EVERY_S:
            last = time.monotonic()
            loss = f"loss {data['loss']:.4f}" if data.get("loss") is not None else ""
            speed = f"{data.get('samples_per_s') or 0:.0f} samples/s"
            console.print(f"  job {job_id} {name}: step {data['step']} {loss} {speed}", highlight=False)
        elif event == "end":
            why = f" ({data['reason']})" if data.get("reason") else ""
            console.print(f"  job {job_id} {name}: {data['state']}{why}", highlight=False)


def _summary(client, job_id: int) -> dict:
    try:
        return client.summary(job_id)
    except Exception:  # a job that failed before writing one: the table says so
        return {}


def _table(rows: list[tuple[dict, dict]]) -> Table:
    table = Table(title="gpuforge demo (through the server)")
    for column in ("job", "name", "state", "steps", "loss", "eval", "samples/s", "device", "wall s"):
        table.add_column(column, no_wrap=True)
    for job, s in rows:
        table.add_row(
            str(job["id"]),
            job["name"],
            job["state"],
            f"{s.get('steps', job['step'] or 0)}/{job['total_steps'] or '?'}",
            f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "-",
            eval_figure(s.get("eval") or {}),
            f"{s.get('samples_per_s') or 0:.1f}",
            f"{s.get('device_type', '-')} {s.get('precision', '')}",
            f"{s['wall_s']:.0f}" if s.get("wall_s") else "-",
        )
    return table


def eval_figure(evaluation: dict) -> str:
    if "accuracy" in evaluation:
        return f"acc {evaluation['accuracy']:.3f}"
    return f"ppl {evaluation['perplexity']:.1f}" if "perplexity" in evaluation else "-"
