"""`gpuforge demo`: start a server on loopback, submit every shipped example to it, follow each to its
end (live metrics lines), print one table of what they did, then deploy the trained text classifier,
ask it a few questions and measure its latency. `--local` trains them in this process instead, with no
server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuforge.errors import GpuforgeError
from gpuforge.runs import RunSummary
from gpuforge.server.local import LocalServer
from gpuforge.spec import load_spec

PRINT_EVERY_S = 2.0  # a metrics line per job at most this often: the log stays readable


QUESTIONS = [
    "a wonderful, moving film with a brilliant cast",
    "the plot was dull and the ending far too long",
    "the striker scored twice in the second half",
    "the central bank raised interest rates again",
]


def demo_via_server(specs: list[Path], home: Path, overrides: list[str], console: Console) -> None:
    console.print(f"starting a gpuforge server (GPUFORGE_HOME={home}, log {home / 'server.log'})")
    with LocalServer(home, log=home / "server.log") as server:
        client = server.client()
        console.print(
            f"dashboard: {server.url}/ (sign in with the key in {home / 'admin.key'}) while the demo runs",
            soft_wrap=True, highlight=False,
        )  # fmt: skip
        ids, tasks = [], {}
        for spec_path in specs:
            spec = load_spec(spec_path, overrides if not _is_script(spec_path) else [])  # its own steps
            job = client.submit(spec)
            ids.append(job["id"])
            tasks[job["id"]] = (spec.model.task if spec.kind == "train" else "script", spec.name)
            console.print(f"submitted {spec_path.name}: job {job['id']}", highlight=False)
        for job_id in ids:
            _follow(client, job_id, console)
        jobs = [client.job(i) for i in ids]
        table = _table([(job, _summary(client, job["id"])) for job in jobs])
        console.print(table)
        served = _pick_classifier(jobs, tasks)
        if served is not None:
            _deploy_and_ask(client, served, console)
    for job in jobs:
        console.print(f"job {job['id']} {job['name']}: {job['run_dir']}", soft_wrap=True, highlight=False)
    console.print(f"the server stopped; its store and runs stay in {home}", soft_wrap=True, highlight=False)
    console.print(
        f"see them again in the dashboard: gpuforge server (GPUFORGE_HOME={home}), or read-only: "
        f"gpuforge dashboard {home / 'runs'}",
        soft_wrap=True, highlight=False,
    )  # fmt: skip


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


def _is_script(spec_path: Path) -> bool:
    return (
        spec_path.parent.name == "scripts"
    )  # examples/scripts/: script jobs, which take no train.* override


def _pick_classifier(jobs: list[dict], tasks: dict[int, tuple[str, str]]) -> dict | None:
    """The finished text classifier to deploy: a sentiment one first (its answers read easily)."""
    finished = [
        j for j in jobs if j["state"] == "finished" and tasks[j["id"]][0] == "sequence-classification"
    ]
    finished.sort(key=lambda j: "sentiment" not in tasks[j["id"]][1])
    return finished[0] if finished else None


def _deploy_and_ask(client, job: dict, console: Console) -> None:
    name = job["name"]
    console.print(f"deploying job {job['id']} ({name}) ...", highlight=False)
    made = client.deploy(job["id"], name, options={"max_batch": 32, "max_wait_ms": 5})
    try:
        deadline = time.monotonic() + 300
        while made["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.5)
            made = client.deployment(name)
        if made["state"] != "ready":
            console.print(f"deployment {name} is {made['state']}: {made.get('reason')}", highlight=False)
            return
        console.print(f"deployment {name}: ready at {client.url}{made['url']}/predict", highlight=False)
        answers = client.predict(name, QUESTIONS)["outputs"]
        for text, output in zip(QUESTIONS, answers, strict=True):
            console.print(
                f"  {output['label']:>10} {output['score']:.3f}  {text}", highlight=False, markup=False
            )
        console.print(_latency_table(client, name))
    finally:
        with contextlib.suppress(GpuforgeError):  # failed already: nothing left to stop
            client.undeploy(name)  # its replica runs in a session of its own: it must not outlive the demo


def _latency_table(client, name: str) -> Table:
    """Client-side latency of one-input requests, alone and 8 at a time, through the server."""
    table = Table(title=f"endpoint {name}: one input a request, through the server")
    for column in ("concurrency", "requests", "req/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for concurrency, count in ((1, 40), (8, 160)):

        def ask(i: int) -> float:
            start = time.perf_counter()
            client.predict(name, [QUESTIONS[i % len(QUESTIONS)]])
            return (time.perf_counter() - start) * 1000

        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            latencies = sorted(pool.map(ask, range(count)))
        seconds = time.perf_counter() - began
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        table.add_row(str(concurrency), str(count), f"{count / seconds:.0f}",
                      f"{statistics.median(latencies):.1f}", f"{p99:.1f}")  # fmt: skip
    return table


def _summary(client, job_id: int) -> RunSummary | None:
    try:
        return RunSummary.model_validate(client.summary(job_id))
    except Exception:  # a job that failed before writing one: the table says so
        return None


def _table(rows: list[tuple[dict, RunSummary | None]]) -> Table:
    table = Table(title="gpuforge demo (through the server)")
    for column in ("job", "name", "state", "steps", "loss", "eval", "samples/s", "device", "wall s"):
        table.add_column(column, no_wrap=True)
    for job, s in rows:
        steps = f"/{job['total_steps'] or '?'}"
        if s is None:  # no summary: loss, eval, speed, device and time unknown
            table.add_row(str(job["id"]), job["name"], job["state"], f"{job['step'] or 0}{steps}", *["-"] * 5)
            continue
        table.add_row(
            str(job["id"]),
            job["name"],
            job["state"],
            f"{s.steps}{steps}",
            f"{s.final_loss:.4f}" if s.final_loss is not None else "-",
            eval_figure(s.eval or {}),
            f"{s.samples_per_s:.1f}" if s.samples_per_s is not None else "-",
            f"{s.device_type} {s.precision}",
            f"{s.wall_s:.0f}" if s.wall_s else "-",
        )
    return table


def eval_figure(evaluation: dict) -> str:
    if "accuracy" in evaluation:
        return f"acc {evaluation['accuracy']:.3f}"
    return f"ppl {evaluation['perplexity']:.1f}" if "perplexity" in evaluation else "-"
