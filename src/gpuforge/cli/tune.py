"""`gpuforge tune`: hyperparameter search (search/).

gpuforge tune SPEC [--tune FILE] --local --out DIR [--parallel N] [--process-per-trial] [--set k=v]...
gpuforge tune show DIR [--json]
gpuforge tune stop DIR
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpuforge.cli.app import Overrides, app, console, out_console
from gpuforge.cli.server import AsJson, KeyFile, Url, client_for
from gpuforge.errors import GpuforgeError

VERBS = ("show", "stop")


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def tune(
    target: Annotated[str, typer.Argument(help="a job spec with a tune: section; or show / stop")],
    search: Annotated[
        str | None, typer.Argument(help="show, stop: the search's id (a server's) or folder (--local's)")
    ] = None,
    tune_file: Annotated[
        Path | None, typer.Option("--tune", help="the tune section in a file of its own, beside any job spec")
    ] = None,
    local: Annotated[bool, typer.Option("--local", help="run it on this machine, without a server")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="--local: the search's folder")] = None,
    parallel: Annotated[
        int | None, typer.Option("--parallel", min=1, max=64, help="trials at once (default: tune.parallel)")
    ] = None,
    process_per_trial: Annotated[
        bool,
        typer.Option(
            "--process-per-trial",
            help="--local: each trial in a fresh process (each pays the imports again; nothing of a "
            "trial's code outlives it), not in a warm worker that runs trial after trial",
        ),
    ] = False,
    max_trials: Annotated[
        int | None, typer.Option("--max-trials", min=1, max=1000, help="override tune.max_trials")
    ] = None,
    set_: Overrides = None,
    as_json: AsJson = False,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """Search hyperparameters: trials of a job with the values a sampler picks, the hopeless ones pruned
    at their evaluations, within a budget of dollars or device-hours."""
    if target in VERBS:
        if search is None:
            raise GpuforgeError(
                f"tune {target}: name the search (gpuforge tune {target} ID, or DIR for --local's)"
            )
        if search.isdigit():  # a server's search
            client = client_for(url, key_file)
            if target == "show":
                _print(client.search_view(int(search)), as_json)
            else:
                stopped = client.stop_search(int(search))
                console.print(f"tune: search {stopped['id']} stops (its trials save a checkpoint first)")
            return
        (_show if target == "show" else _stop)(Path(search), as_json)
        return
    if search is not None:
        raise GpuforgeError(f"tune {target} {search}: one spec (the verbs are {', '.join(VERBS)})")
    from gpuforge.spec import load_search

    spec = load_search(target, tune_file, list(set_ or []))
    if max_trials is not None:
        spec.tune.max_trials = max_trials
    if not local:
        if out is not None or parallel is not None or process_per_trial:
            raise GpuforgeError(
                "tune: --out, --parallel and --process-per-trial are for --local (a server's search: "
                "tune.parallel; each trial a job)"
            )
        started = client_for(url, key_file).search(spec)
        if as_json:
            out_console.print(json.dumps({"id": started["id"]}), highlight=False, markup=False)
        else:
            out_console.print(f"search {started['id']} started: gpuforge tune show {started['id']}",
                              highlight=False, markup=False)  # fmt: skip
        return
    from gpuforge.executors import build as build_executor
    from gpuforge.search.local import LocalSearch
    from gpuforge.settings import current as environment

    # an executor that runs every job's ranks elsewhere (Ray, Slurm) does so from a process of its own
    process_per_trial = process_per_trial or build_executor(environment()).launches_ranks

    out = out or Path("runs") / f"{spec.job.name}-search"
    say = (lambda line: None) if as_json else (
        lambda line: out_console.print(f"tune: {line}", highlight=False, markup=False, soft_wrap=True)
    )  # fmt: skip
    state = LocalSearch(spec, out, parallel, announce=say, process_per_trial=process_per_trial).run()
    if as_json:
        _show(out, True)
        return
    _show(out, False)
    if state == "paused":
        raise typer.Exit(3)


def _show(folder: Path, as_json: bool) -> None:
    from gpuforge.search.local import open_search, read_state
    from gpuforge.search.report import describe

    search, study = open_search(folder)
    _print(describe(study, read_state(folder), search.tune), as_json)


def _print(doc: dict, as_json: bool) -> None:
    if as_json:
        out_console.print(json.dumps(doc), highlight=False, soft_wrap=True, markup=False)
        return
    out_console.print(_table(doc))
    best = doc["best"]
    metric = doc["objective"]["metric"]
    if best:
        out_console.print(
            f"best: trial {best['trial']}, {metric} {best['value']:.4g}, {_params(best['params'])}\n"
            + (f"its model: {best['run']}/model" if best.get("run") else f"its job: {best['job']}"),
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
    if doc["importances"]:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in doc["importances"].items())
        out_console.print(f"importances: {shown}", highlight=False, markup=False)
    budget = doc["budget"]
    left = []
    if budget["usd"] is not None:
        left.append(f"${budget['usd_left']:.4f} of ${budget['usd']:g} left")
    if budget["hours"] is not None:
        left.append(f"{budget['hours_left']:.3f} of {budget['hours']:g} device-hours left")
    out_console.print(
        f"{doc['state']}{': ' + doc['reason'] if doc['reason'] else ''}; spent ${doc['spent_usd']:.4f}, "
        f"{doc['device_hours']:.4f} device-hours" + (f" ({'; '.join(left)})" if left else ""),
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _table(doc: dict) -> Table:
    table = Table(title=f"{doc['objective']['metric']} ({doc['objective']['direction']})")
    for column in ("trial", "job", "state", "parameters", "value", "steps", "cost $", "why"):
        table.add_column(column, overflow="fold")
    for t in doc["trials"]:
        table.add_row(
            str(t["number"]), "-" if t.get("job") is None else str(t["job"]), t["state"],
            _params(t["params"]),
            "" if t["value"] is None else f"{t['value']:.4g}",
            "" if t["steps"] is None else str(t["steps"]), f"{t['cost_usd']:.5f}", t["reason"] or "",
        )  # fmt: skip
    return table


def _stop(folder: Path, as_json: bool) -> None:
    from gpuforge.search.local import request_stop

    request_stop(folder)
    console.print(f"tune: asked the search in {folder} to stop (its trials save a checkpoint first)")


@app.command()
def tunes(url: Url = None, key_file: KeyFile = None, as_json: AsJson = False) -> None:
    """List the server's searches this key may read: id, name, owner, state, why it ended."""
    rows = client_for(url, key_file).searches()
    if as_json:
        out_console.print(json.dumps(rows), highlight=False, soft_wrap=True, markup=False)
        return
    table = Table(title="gpuforge searches")
    for column in ("id", "name", "owner", "state", "why"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(str(r["id"]), r["name"], r["owner"] or "-", r["state"], r["reason"] or "")
    out_console.print(table)
