"""Deployments through the server (these verbs join `gpuforge.cli.app`):

gpuforge deploy JOB_ID --name NAME [--replicas N] [--min-replicas A --max-replicas B]
                [--target-queue Q] [--scale-down-after S] [--max-batch 32] [--quantize int8]
                [--wait [--timeout S]]   progress on stderr; gives up, saying why, after S (300)
gpuforge deploy JOB_ID --name NAME            on a live NAME: its next version, rolled out
                [--max-metric-drop X] [--wait]   replica by replica once its eval metric is checked
gpuforge deploy JOB_ID --into NAME [--adapter-name A]   a LoRA job's adapter, into a running one
gpuforge deployments [NAME] [--all] [--versions | --events] [--json]
gpuforge rollback NAME [--to V]
gpuforge undeploy NAME [--adapter A]
gpuforge predict NAME TEXT... [--adapter A] [--json]
"""

from __future__ import annotations

import datetime
import time
from typing import Annotated

import typer
from rich.table import Table

from gpuforge.cli.app import app, console, out_console
from gpuforge.cli.server import AsJson, KeyFile, Url, _print_json, client_for
from gpuforge.errors import GpuforgeError

ROLLOUT_WAIT_S = 300.0  # deploy --wait's default --timeout


@app.command()
def deploy(
    job_id: Annotated[int | None, typer.Argument(help="the finished job whose model to serve")] = None,
    search: Annotated[
        int | None, typer.Option("--tune", help="instead of a job: this search's best finished trial")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="the deployment's name (its address)")] = None,
    into: Annotated[
        str | None, typer.Option("--into", help="add the job's LoRA adapter to this running deployment")
    ] = None,
    adapter_name: Annotated[
        str | None, typer.Option("--adapter-name", help="with --into: its name (default: the job's)")
    ] = None,
    replicas: Annotated[int | None, typer.Option(min=0, help="replicas at the start (default 1)")] = None,
    devices: Annotated[
        float | None,
        typer.Option(help="what each replica holds: 1 (a whole device) or a fraction of one, e.g. 0.5"),
    ] = None,
    min_replicas: Annotated[
        int | None, typer.Option(min=0, help="autoscaling's floor; 0 scales to zero")
    ] = None,
    max_replicas: Annotated[int | None, typer.Option(min=1, help="autoscaling's ceiling")] = None,
    target_queue: Annotated[
        float | None, typer.Option(help="requests in flight per ready replica above which one is added")
    ] = None,
    scale_down_after: Annotated[
        float | None, typer.Option(help="seconds with no request before a replica is removed")
    ] = None,
    max_metric_drop: Annotated[
        float | None, typer.Option(help="a new version's eval metric may fall by this much (default 0.01)")
    ] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="inputs per batch at most")] = None,
    max_wait_ms: Annotated[
        float | None,
        typer.Option(
            min=0, help="how long a batch waits to fill, once one is coming (never for a lone request)"
        ),
    ] = None,
    quantize: Annotated[str | None, typer.Option(help="int8 | int4 | int8-dynamic, at load")] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", help="a variant of the job's compress: section, e.g. compressed/onnx-int8"),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="return once it is ready (a new version: once it serves)")
    ] = False,
    wait_timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="with --wait: give up after this many seconds")
    ] = ROLLOUT_WAIT_S,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Serve a finished job's model through the server (started, watched, restarted and scaled by it); on
    the name of a live deployment, make it that deployment's next version; with --into, add a LoRA job's
    adapter to a running deployment."""
    client = client_for(url, key_file)
    job_id = _job_or_best_trial(client, job_id, search)
    if into is not None:
        if name is not None:
            raise GpuforgeError("deploy: --name or --into, not both")
        made = client.add_adapter(into, job_id, adapter_name)
        _say(made, as_json, f"deployment {into}: adapters {', '.join(made['adapters'])}")
        return
    if name is None:
        raise GpuforgeError("deploy: --name NAME (a new deployment or a new version) or --into NAME")
    options = {"max_batch": max_batch, "max_wait_ms": max_wait_ms, "quantize": quantize}
    made = client.deploy(
        job_id, name, {k: v for k, v in options.items() if v is not None}, replicas=replicas,
        min_replicas=min_replicas, max_replicas=max_replicas, target_queue=target_queue, devices=devices,
        scale_down_after_s=scale_down_after, max_metric_drop=max_metric_drop, model=model,
    )  # fmt: skip
    version = made.get("rolling_version")
    if made.get("note") and not as_json:
        console.print(f"deployment {name}: note: {made['note']}", highlight=False, markup=False)
    if wait:
        made = _wait_for(client, name, version, wait_timeout)
    where = f"POST {client.url}{made['url']}/predict"
    if version is not None and not wait:
        _say(made, as_json, f"deployment {name}: v{version} rolling out (v{made['version']} serves); {where}")
    else:
        _say(made, as_json, f"deployment {name}: {made['state']}, v{made['version']}; {where}")


def _job_or_best_trial(client, job_id: int | None, search: int | None) -> int:
    """The job to deploy: the one named, or a search's best finished trial (gpuforge tune show ID)."""
    if (job_id is None) == (search is None):
        raise GpuforgeError("deploy: name a JOB, or --tune SEARCH for its best trial (one of the two)")
    if job_id is not None:
        return job_id
    best = client.search_view(search)["best"]
    if best is None or best.get("job") is None:
        raise GpuforgeError(
            f"deploy --tune {search}: the search has no finished trial yet (gpuforge tune show {search})"
        )
    console.print(
        f"deploy: search {search}'s best trial {best['trial']} is job {best['job']}", highlight=False
    )
    return best["job"]


def _wait_for(client, name: str, version: int | None, timeout_s: float) -> dict:
    """The deployment once ready (a new version: once it serves, or a GpuforgeError saying why not); what
    it is doing goes to stderr as it changes, and past `timeout_s` a GpuforgeError says where it stands."""
    deadline, said = time.monotonic() + timeout_s, None
    while True:
        made = client.deployment(name)
        if version is None and made["state"] != "starting":
            if made["state"] != "ready":
                raise GpuforgeError(f"deployment {name} is {made['state']}: {made.get('reason')}")
            return made
        if version is not None and made.get("rolling_version") != version:
            mine = next(v for v in client.deployment_versions(name) if v["version"] == version)
            if mine["state"] != "serving":
                raise GpuforgeError(f"deployment {name}: v{version} {mine['state']}: {mine.get('reason')}")
            return made
        now = _progress(made)
        if now != said:
            console.print(f"deployment {name}: {now}", highlight=False, markup=False)
            said = now
        if time.monotonic() > deadline:
            raise GpuforgeError(
                f"deployment {name}: gave up waiting after {timeout_s:g} s ({now}); it goes on in the "
                f"server: `gpuforge deployments {name}` shows it, `gpuforge rollback {name}` or "
                f"`gpuforge undeploy {name}` ends it"
            )
        time.sleep(0.5)


def _progress(d: dict) -> str:
    """Where a starting deployment or a rollout stands, one line: each replica's state, and why one waits."""
    parts = []
    for w in d["workers"]:
        if w.get("waiting"):
            state = f"waiting ({w['waiting']})"
        elif w.get("draining"):
            state = "stopping"
        elif w.get("ready"):
            state = f"serving on {w['device']}"
        elif w.get("pid"):
            state = f"loading on {w['device']}"
        else:
            state = "to start"
        parts.append(f"replica {w['index']} (v{w['version']}) {state}")
    rolling = f"v{d['rolling_version']} rolling out; " if d.get("rolling_version") else ""
    return rolling + ("; ".join(parts) or "no replica yet")


def _say(made: dict, as_json: bool, line: str) -> None:
    if as_json:
        _print_json(made)
    else:
        out_console.print(line, highlight=False, markup=False)


@app.command()
def deployments(
    name: Annotated[
        str | None, typer.Argument(help="one deployment (its replicas, versions or events)")
    ] = None,
    versions: Annotated[bool, typer.Option("--versions", help="its versions, newest first")] = False,
    events: Annotated[bool, typer.Option("--events", help="what happened to it: rollouts, scaling")] = False,
    every: Annotated[bool, typer.Option("--all", help="stopped and failed ones too")] = False,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """List the live deployments (--all: the stopped and failed too): name, version, state, ready
    replicas, address. With NAME: that one's replicas, --versions or --events."""
    client = client_for(url, key_file)
    if (versions or events) and name is None:
        raise GpuforgeError("deployments: --versions and --events need a deployment's NAME")
    if versions:
        rows = client.deployment_versions(name)
        columns = ("version", "job", "state", "metric", "why")
        _table(rows, as_json, f"deployment {name}: versions", columns, _version_cells)
    elif events:
        rows = client.deployment_events(name)
        _table(rows, as_json, f"deployment {name}: events", ("when", "event", "what"), _event_cells)
    elif name is not None:
        d = client.deployment(name)
        if as_json:
            _print_json(d)
            return
        title = (f"deployment {name}: {d['state']}, v{d['version']}, {d['replicas']} replica(s) wanted "
                 f"({d['min_replicas']}..{d['max_replicas']})")  # fmt: skip
        columns = ("replica", "version", "device", "ready", "restarts", "adapters")
        _table(d["workers"], False, title, columns, _replica_cells)
    else:
        rows = client.deployments(every)
        columns = ("name", "version", "job", "state", "ready", "address")
        _table(rows, as_json, "gpuforge deployments", columns, lambda d: _deployment_cells(d, client.url))


def _version_cells(v: dict) -> tuple[str, ...]:
    metric = _metric(v["metric"], v["state"])
    return f"v{v['version']}", str(v["job_id"]), v["state"], metric, v.get("reason") or ""


def _event_cells(e: dict) -> tuple[str, ...]:
    return _clock(e["ts"]), e["kind"], ", ".join(f"{k}={v}" for k, v in e["data"].items())


def _replica_cells(w: dict) -> tuple[str, ...]:
    ready = "draining" if w["draining"] else str(w["ready"]).lower()
    return (
        str(w["index"]),
        f"v{w['version']}",
        w["device"] or (f"waiting: {w['waiting']}" if w.get("waiting") else ""),
        ready,
        str(w["restarts"]),
        ", ".join(w["adapters"]),
    )


def _deployment_cells(d: dict, url: str) -> tuple[str, ...]:
    version = f"v{d['version']}" + (f" (v{d['rolling_version']} rolling)" if d.get("rolling_version") else "")
    ready = f"{sum(w['ready'] for w in d['workers'])}/{d['replicas']}"
    return d["name"], version, str(d["job_id"]), d["state"], ready, f"{url}{d['url']}/predict"


def _table(rows, as_json: bool, title: str, columns: tuple[str, ...], cells) -> None:
    if as_json:
        _print_json(rows)
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*cells(row))
    out_console.print(table)


def _metric(metric: dict | None, state: str) -> str:
    if not metric:
        return "(not measured yet)" if state == "rolling" else "(not measured)"
    if metric.get("value") is None:
        return metric.get("note", "none")
    return f"{metric['metric']} {metric['value']:.4f} ({metric.get('examples', '?')} examples)"


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def rollback(
    name: str,
    to: Annotated[
        int | None, typer.Option("--to", help="the version to serve again (default: the one before)")
    ] = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Serve a version the deployment served before, rolled out replica by replica (a rollout under way
    is stopped first: without --to, that is the whole rollback)."""
    made = client_for(url, key_file).rollback(name, to)
    rolling = made.get("rolling_version")
    _say(
        made,
        as_json,
        f"deployment {name}: " + (f"v{rolling} rolling out" if rolling else f"v{made['version']} serves"),
    )


@app.command()
def undeploy(
    name: str,
    adapter: Annotated[
        str | None, typer.Option("--adapter", help="only remove this adapter (added with deploy --into)")
    ] = None,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """Stop a deployment's replicas (each finishes what it holds), or with --adapter stop serving one
    adapter of it."""
    client = client_for(url, key_file)
    if adapter is not None:
        d = client.remove_adapter(name, adapter)
        out_console.print(
            f"deployment {name}: adapters {', '.join(d['adapters']) or '(none)'}", highlight=False
        )
        return
    d = client.undeploy(name)
    out_console.print(f"deployment {d['name']}: {d['state']}", highlight=False)


@app.command()
def predict(
    name: str,
    inputs: Annotated[list[str], typer.Argument(help="texts")],
    adapter: Annotated[str | None, typer.Option(help="a LoRA adapter the deployment serves")] = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Ask a deployment: one line per input, its label and score (--json: the server's answer)."""
    answer = client_for(url, key_file).predict(name, list(inputs), adapter)
    if as_json:
        _print_json(answer)
        return
    for text, output in zip(inputs, answer["outputs"], strict=True):
        out_console.print(f"{output['label']}\t{output['score']:.3f}\t{text}", highlight=False, markup=False)
