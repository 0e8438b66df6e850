"""Verbs that run on this machine with no server: train, demo, plan, compress, hw, dashboard."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gpuforge.cli.app import (
    EXIT_PAUSED,
    MaxSteps,
    Overrides,
    SpecPath,
    app,
    console,
    out_console,
    run_announced,
)
from gpuforge.cli.profile import ProfileSteps, profile_overrides
from gpuforge.cli.server import KeyFile, Url, client_for
from gpuforge.errors import GpuforgeError

if TYPE_CHECKING:
    from gpuforge.runs import RunSummary


def _default_out(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _run_job(spec_path: Path, out: Path | None, overrides: list[str], quiet: bool = False):
    # imported here so `gpuforge --help` stays fast (torch and transformers take seconds to import)
    from gpuforge.admission import check_spec
    from gpuforge.executors import build as build_executor
    from gpuforge.policy import current
    from gpuforge.runs import RunResult
    from gpuforge.settings import current as environment
    from gpuforge.spec import load_train_spec

    job = load_train_spec(spec_path, overrides, "train")
    check_spec(current(), job)  # a runner the server started holds to its job's policy, whatever the file
    # torch only once the spec holds: a mistyped spec is refused in a second, not after torch's import
    from gpuforge.train.engine import train as run_training
    from gpuforge.train.progress import Reporter, RichReporter

    out = out or _default_out(job.name)
    # several processes, or an executor whose every job runs elsewhere: this process launches the ranks
    executor = build_executor(environment())  # as the server that started this runner told it
    if job.distributed.strategy != "none" or executor.launches_ranks:
        return job, out, RunResult.model_validate(executor.launch_ranks(job, out))
    summary = run_training(job, out, Reporter() if quiet else RichReporter(console))
    return job, out, RunResult.model_validate(summary)


def _describe(summary: RunSummary) -> str:
    evaluation = summary.eval or {}
    metric = (
        f"eval accuracy {evaluation['accuracy']:.3f}"
        if "accuracy" in evaluation
        else f"eval perplexity {evaluation['perplexity']:.2f}"
        if "perplexity" in evaluation
        else "no eval"
    )
    loss = summary.final_loss
    progress = f"{summary.status} at step {summary.steps}/{summary.total_steps}"
    figures = f"loss {loss:.4f}, {metric}, " if loss is not None else ""
    speed = f"{summary.samples_per_s or 0:.1f} samples/s on {summary.device_type} ({summary.precision})"
    return f"{progress}, {figures}{speed}, ${summary.cost_usd:.4f}"


@app.command()
def train(
    spec: SpecPath,
    out: Annotated[
        Path | None, typer.Option("--out", help="run directory; resumes if it holds checkpoints")
    ] = None,
    max_steps: MaxSteps = None,
    set_: Overrides = None,
    profile_steps: ProfileSteps = None,
) -> None:
    """Train a job locally, with no server, into a run directory."""
    overrides = list(set_ or []) + ([f"train.max_steps={max_steps}"] if max_steps else [])
    overrides += profile_overrides(profile_steps)
    if _is_script(spec):
        if profile_steps:
            raise GpuforgeError("--profile: a script job runs its own loop, which gpuforge does not profile")
        _run_script(spec, out, overrides, max_steps)
        return
    job, out, summary = _run_job(spec, out, overrides)
    out_console.print(f"{_describe(summary)}\nrun directory: {out}")
    if summary.status == "finished" and summary.reason:  # train.early_stop, stop_at, keep_best said why
        out_console.print(summary.reason, markup=False, highlight=False)
    if summary.signal:
        raise typer.Exit(128 + summary.signal)
    if summary.status == "paused":
        from gpuforge.launch.script import budget_hint  # a server's job: `gpuforge resume`, not a rerun

        out_console.print(f"paused: {summary.reason}; {budget_hint(summary.cost_usd)}", markup=False)
        raise typer.Exit(EXIT_PAUSED)
    _compress_after(job, out, summary)


def _is_script(spec: Path) -> bool:
    """Whether the spec file says `kind: script` (read cheaply: a spec job's path imports nothing more)."""
    import yaml

    try:
        raw = yaml.safe_load(spec.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False  # load_spec reports it, with the line
    return isinstance(raw, dict) and raw.get("kind") == "script"


def _run_script(spec: Path, out: Path | None, overrides: list[str], max_steps: int | None) -> None:
    if max_steps:
        raise GpuforgeError("--max-steps: a script job counts its own steps (pass them in script.command)")
    _, out, summary = _run_script_job(spec, out, overrides)
    from gpuforge.launch.script import budget_hint

    spent = summary.status == "paused" and (summary.reason or "").startswith("cost.budget_usd")
    out_console.print(
        f"{summary.status}: {summary.steps} steps reported, {summary.wall_s:.1f} s"
        + (f", {summary.reason}" if summary.reason else "")
        + (f"; {budget_hint(summary.cost_usd)}" if spent else "")
        + f"\nrun directory: {out}",
        highlight=False,
        markup=False,
    )
    if summary.status == "failed":
        raise typer.Exit(1)
    if summary.status == "paused":
        raise typer.Exit(EXIT_PAUSED)
    if summary.status == "cancelled":
        raise typer.Exit(130 if summary.reason.startswith("SIGINT") else 143)


def _run_script_job(spec: Path, out: Path | None, overrides: list[str] = ()):
    """Run a script job's spec into `out` (default: runs/<name>-<time>): (spec, out, summary)."""
    from gpuforge.admission import check_script
    from gpuforge.launch.script import run_script
    from gpuforge.policy import current
    from gpuforge.spec import load_spec

    job = load_spec(spec, list(overrides))
    check_script(current(), job)  # a runner the server started holds to its job's policy, whatever the file
    out = out or _default_out(job.name)
    return job, out, run_script(job, out)


def _demo_row(name: str, s: RunSummary) -> list[str]:
    """A row of `demo --local`'s table (a script job leaves its speed and precision to itself: -)."""
    from gpuforge.demo import eval_figure

    return [
        name,
        f"{s.steps} {s.status}",
        f"{s.final_loss:.4f}" if s.final_loss is not None else "-",
        eval_figure(s.eval or {}),
        f"{s.samples_per_s:.1f}" if s.samples_per_s is not None else "-",
        f"{s.device_type} {s.precision or '-'}",
        f"{s.wall_s:.0f}",
    ]


def _compress_after(job, out: Path, summary: RunSummary) -> None:
    """The spec's `compress:` section, on a run that finished: <run>/compressed and its table."""
    if summary.status != "finished" or not job.compress.requested:
        return
    from gpuforge.compress.pipeline import compress_run
    from gpuforge.compress.report import table

    out_console.print(table(compress_run(job, out)))
    out_console.print(f"compressed: {out / 'compressed'}", soft_wrap=True)


@app.command()
def demo(
    examples: Annotated[Path, typer.Option(help="folder of example specs")] = Path("examples"),
    out: Annotated[Path, typer.Option("--out", help="parent folder of the demo's run directories")] = Path(
        "runs/demo"
    ),
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", min=1, help="cap every example's steps")
    ] = None,
    local: Annotated[bool, typer.Option("--local", help="train here, without a server")] = False,
) -> None:
    """Start a server, submit every shipped example, follow them to the end (compressing where a spec
    asks), and print what they did; --local trains them in this process instead."""
    specs = sorted(examples.glob("*.yaml"))
    if not specs:
        raise GpuforgeError(f"--examples {examples}: no *.yaml example specs there")
    scripts = sorted((examples / "scripts").glob("*.yaml"))  # a team's own code, as script jobs
    if not local:
        from gpuforge.demo import demo_via_server

        overrides = [f"train.max_steps={max_steps}"] if max_steps else []
        demo_via_server(specs + scripts, (out / "server").absolute(), overrides, out_console)
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    table = Table(title="gpuforge demo")
    for column in ("job", "steps", "loss", "eval", "samples/s", "device", "wall s"):
        table.add_column(column, no_wrap=True)
    run_dirs = []
    for spec_path in specs:
        out_console.print(f"[bold]{spec_path.name}[/bold]")
        overrides = [f"train.max_steps={max_steps}"] if max_steps else []
        job, run_dir, s = _run_job(spec_path, out / f"{spec_path.stem}-{stamp}", overrides)
        _compress_after(job, run_dir, s)
        run_dirs.append((job.name, run_dir))
        table.add_row(*_demo_row(job.name, s))
    for spec_path in scripts:  # their own steps: --max-steps is not theirs to take
        out_console.print(f"[bold]{spec_path.name}[/bold] (script job)")
        job, run_dir, s = _run_script_job(spec_path, out / f"{spec_path.stem}-{stamp}")
        run_dirs.append((job.name, run_dir))
        table.add_row(*_demo_row(job.name, s))
    out_console.print(table)
    for name, run_dir in run_dirs:
        out_console.print(f"{name}: {run_dir.resolve()}", soft_wrap=True)
    out_console.print(
        "each run directory holds summary.json, metrics.jsonl, events.jsonl, model/, checkpoints/"
    )


@app.command()
def plan(
    spec: SpecPath,
    measure: Annotated[
        bool, typer.Option("--measure", help="time real steps (shown beside the roofline estimate)")
    ] = False,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="devices to price the job on, e.g. h100,a100-80gb,l4,cpu (catalog names; cpu: this one)",
        ),
    ] = None,
    link_gbps: Annotated[
        float | None,
        typer.Option("--link-gbps", help="with --compare: the link between devices, in Gbit/s", min=0.001),
    ] = None,
    max_steps: MaxSteps = None,
    set_: Overrides = None,
    tune_file: Annotated[
        Path | None, typer.Option("--tune", help="a search's tune section: plan the search (its cost range)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Say before anything runs: parameters, memory, batch, time and cost; refuse a job that cannot fit.
    With --compare: the same job's memory, batch, step time, total time and cost on each device named. A
    search's spec (a tune: section, or --tune FILE): one trial's plan, and the search's cost range."""
    import json

    from gpuforge.spec import load_train_spec

    overrides = list(set_ or []) + ([f"train.max_steps={max_steps}"] if max_steps else [])
    if tune_file is not None or _has_tune_section(spec):
        _plan_search(spec, tune_file, overrides, measure, as_json)
        return
    if compare is not None:
        from gpuforge.plan.compare import compare as compare_devices
        from gpuforge.plan.compare import notes, table

        job = load_train_spec(spec, overrides, "plan --compare")
        result = compare_devices(job, compare.split(","), measure, link_gbps)
        if as_json:
            out_console.print_json(json.dumps(result.as_dict()))
        else:
            out_console.print(table(result))
            for line in notes(result):
                out_console.print(line, highlight=False, markup=False, soft_wrap=True)
        if not result.fits_somewhere:
            raise GpuforgeError(result.verdict())
        return
    if link_gbps is not None:
        raise GpuforgeError("--link-gbps: only with --compare")
    from gpuforge.plan import make_plan, process_age_s, table

    launched = process_age_s()  # the interpreter and imports, which `gpuforge train` pays alike
    result = make_plan(load_train_spec(spec, overrides, "plan"), measure=measure, launched_s=launched)
    if as_json:
        out_console.print_json(json.dumps(result.as_dict()))
    else:
        out_console.print(table(result))
    if result.step_time_reliable is False:
        console.print(
            "gpuforge plan: the step time is unreliable (its measured steps moved "
            f"±{result.step_time_spread:.0%} between windows: a busy machine?); measure again when quieter",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    if not result.fits:
        raise GpuforgeError(result.verdict)


def _has_tune_section(spec: Path) -> bool:
    import yaml

    try:
        raw = yaml.safe_load(spec.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False  # load_train_spec says what is wrong with it
    return isinstance(raw, dict) and "tune" in raw


def _plan_search(
    spec: Path, tune_file: Path | None, overrides: list[str], measure: bool, as_json: bool
) -> None:
    """One trial's plan (the job at its own values), and what the search is expected to cost."""
    import json

    from gpuforge.plan import make_plan, process_age_s, table
    from gpuforge.plan.search import plan_search
    from gpuforge.spec import load_search

    search = load_search(spec, tune_file, overrides)
    one = make_plan(search.job, measure=measure, launched_s=process_age_s())
    searched = plan_search(search, one.total_time_s, one.startup_s, one.usd_per_hour, one.total_steps)
    if as_json:
        out_console.print_json(json.dumps({"trial": one.as_dict(), "search": searched.as_dict()}))
    else:
        out_console.print(table(one))
        out_console.print(searched.line(), highlight=False, markup=False, soft_wrap=True)
    if not one.fits:
        raise GpuforgeError(one.verdict)


@app.command()
def compress(
    model_dir: Annotated[Path, typer.Argument(help="a trained model directory: <run>/model")],
    out: Annotated[Path, typer.Option("--out", help="where the compressed model (or the sweep) goes")],
    # CompressOptions' fields, written out so that no verb pays for pydantic at start-up;
    # tests/test_cli.py keeps their flags, defaults and help equal to compress/options.py's
    prune: Annotated[
        float, typer.Option("--prune", help="fraction of weights (or channels) to remove")
    ] = 0.0,
    prune_structure: Annotated[
        str, typer.Option("--prune-structure", help="unstructured | 2:4 | channel")
    ] = "unstructured",
    quantize: Annotated[str | None, typer.Option("--quantize", help="int8 | int4 | int8-dynamic")] = None,
    merge: Annotated[bool, typer.Option("--merge", help="fold a LoRA adapter into its base")] = False,
    recover_steps: Annotated[
        int, typer.Option("--recover-steps", help="fine-tune steps after pruning, on the run's data")
    ] = 0,
    recover_lr: Annotated[float | None, typer.Option("--recover-lr", help="default: the run's lr")] = None,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="try the useful combinations, mark the best")
    ] = False,
    spec: Annotated[
        Path | None, typer.Option("--spec", help="the run's spec (default: <model_dir>/../spec.yaml)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite a non-empty --out")] = False,
    onnx: Annotated[
        bool, typer.Option("--onnx", help="with --sweep: the ONNX exports too (fp32, int8; gpuforge[export])")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print report.json instead of the table")] = False,
) -> None:
    """Prune, quantize or merge a trained model; report size, latency and accuracy against the original."""
    import json

    from gpuforge.compress import pipeline
    from gpuforge.compress.options import CompressOptions
    from gpuforge.compress.report import table

    if onnx and not sweep:
        raise GpuforgeError("--onnx: with --sweep (one export alone: gpuforge export --format onnx)")
    if sweep:
        rows = pipeline.sweep(model_dir, out, recover_steps, force, spec, onnx=onnx)
    else:
        options = CompressOptions(
            prune=prune, prune_structure=prune_structure, quantize=quantize, merge=merge,
            recover_steps=recover_steps, recover_lr=recover_lr,
        )  # fmt: skip
        if options == CompressOptions():  # the defaults: a variant that changes nothing
            raise GpuforgeError("compress: nothing to do; pass --prune, --quantize, --merge or --sweep")
        rows = pipeline.compress(model_dir, options, out, force, spec)
    if as_json:
        out_console.print_json(json.dumps({"variants": rows}))
    else:
        out_console.print(table(rows))
        out_console.print(f"report: {out / 'report.json'}", highlight=False, markup=False)


@app.command()
def export(
    model_dir: Annotated[Path, typer.Argument(help="a trained model directory: <run>/model, or a variant")],
    out: Annotated[
        Path, typer.Option("--out", help="the export's directory (new, empty, or an earlier export)")
    ],
    format: Annotated[str, typer.Option("--format", help="onnx")] = "onnx",
    quantize: Annotated[
        str | None, typer.Option("--quantize", help="int8: onnxruntime's dynamic quantization")
    ] = None,
    opset: Annotated[
        int, typer.Option("--opset", help="the ONNX opset to write (14 to 21; 18: the dynamo exporter's own)")
    ] = 18,
    as_json: Annotated[
        bool, typer.Option("--json", help="print export_report.json instead of the table")
    ] = False,
) -> None:
    """Export a trained model for another runtime (ONNX, served by onnxruntime), and measure its parity
    with the torch model on the run's held-out split: export_report.json in --out."""
    import json

    if format != "onnx":
        raise GpuforgeError(f"--format {format}: onnx is the one format this release exports")
    from gpuforge.export.onnx import export_onnx
    from gpuforge.export.parity import measure_parity

    manifest, _module, built = export_onnx(model_dir, out, quantize, opset)
    report = measure_parity(model_dir, out, built, manifest)
    if as_json:
        out_console.print_json(json.dumps(report))
        return
    out_console.print(_export_table(report))
    out_console.print(f"export: {out} (report: {out / 'export_report.json'})", highlight=False, markup=False)


def _export_table(report: dict) -> Table:
    from gpuforge.compress.report import size_text
    from gpuforge.export.parity import latency_rows

    quantized = f", {report['quantize']}" if report["quantize"] else ""
    title = f"ONNX export ({report['exporter']} exporter, opset {report['opset']}{quantized}) against torch"
    table = Table(title=title)
    for column in ("", "torch", "onnxruntime"):
        table.add_column(column, justify="right")
    metric = report.get("metric")
    if metric:
        table.add_row(
            f"eval {metric['name']} ({report['examples']})", f"{metric['torch']:.4f}", f"{metric['onnx']:.4f}"
        )
        table.add_row("max |logit difference|", "", f"{report['max_abs_diff']:.2e}")
        table.add_row("same class picked", "", f"{report['argmax_agreement']:.1%}")
    decode = report.get("decode")
    if decode:
        steps = f"{decode['prompts']} prompts x {decode['steps']} steps"
        table.add_row(f"decode |logit difference| ({steps})", "", f"{decode['max_abs_diff']:.2e}")
        table.add_row("decode: same token picked", "", f"{decode['same_token']:.1%}")
    size = report["bytes"]
    table.add_row("bytes", size_text(size["torch"]), f"{size_text(size['onnx'])} ({size['ratio']:.2f}x)")
    for row in latency_rows(report):  # each with its spread, or "unreliable"; a batch's also per sample
        table.add_row(*row)
    for check, met in report["checks"].items():
        table.add_row(check, "", "unmeasured" if met is None else "yes" if met else "NO")
    return table


@app.command()
def hw(
    refresh: Annotated[
        bool, typer.Option("--refresh", help="measure again (the figures are cached)")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the figures as JSON, units in their names")
    ] = (False),
) -> None:
    """Measure this machine like the article's table: each device's cores, memory, memory bandwidth,
    matmul speed per precision, host<->device copies, the all-reduce between local processes and the
    OpenCL devices, each beside its datasheet figure where the model is known. Cached per machine."""
    import json

    from gpuforge.hardware.probe import device_name, select_device
    from gpuforge.hardware.report import report, tables
    from gpuforge.runtime.precision import choose_precision

    result = report(refresh=refresh)
    if as_json:
        out_console.print_json(json.dumps(result))
        return
    for part in tables(result):
        out_console.print(part)
    device = select_device("auto")
    precision = choose_precision("auto", device)
    out_console.print(
        f"a job runs on {device_name(device)} ({device.type}); precision auto picks {precision.name}: "
        f"{precision.reason.removeprefix('auto: ')}"  # the reason says "auto:" for the run's log
    )


@app.command()
def dashboard(
    runs_dir: Annotated[Path, typer.Argument(help="a run directory, or a folder of them (e.g. runs/)")],
    port: Annotated[int, typer.Option(help="the loopback port to listen on")] = 8700,
    host: Annotated[str, typer.Option(help="a loopback address: the dashboard is for this machine")] = (
        "127.0.0.1"
    ),
) -> None:
    """Serve the web dashboard's job, compare and report pages over local run directories, read-only. It
    prints the key to sign in with, made at each start (others on this machine reach loopback too)."""
    import secrets

    from gpuforge.access import is_loopback
    from gpuforge.dashboard.local import create_local_app, find_runs

    if not is_loopback(host):
        raise GpuforgeError(
            f"--host {host}: the dashboard serves your runs to this machine only: a loopback address"
        )
    if not runs_dir.is_dir():
        raise GpuforgeError(f"{runs_dir}: no such directory")
    key = "gfd_" + secrets.token_urlsafe(24)
    found = len(find_runs(runs_dir.resolve()))
    out_console.print(f"sign in with the key {key} (it opens these runs, read-only, until this stops)",
                      highlight=False, markup=False, soft_wrap=True)  # fmt: skip
    what = f"{found} run{'s' if found != 1 else ''} under {runs_dir.resolve()}"
    run_announced(create_local_app(runs_dir, key), "dashboard", host, port, what)


prices_app = typer.Typer(
    no_args_is_help=True,
    help="What each device costs an hour ($GPUFORGE_HOME/prices.yaml): the server prices jobs with it.",
)
app.add_typer(prices_app, name="prices")


@prices_app.command("list")
def prices_list(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    url: Url = None,
    key_file: KeyFile = None,
    here: Annotated[
        bool,
        typer.Option("--local", help="this machine's $GPUFORGE_HOME/prices.yaml, even with a server URL"),
    ] = False,
) -> None:
    """Each priced device (a name as the server lists it, or a kind: cuda, cpu), its hourly cost and parts:
    the server's (--url or $GPUFORGE_URL: each of its devices, priced or not), else this machine's file."""
    import json
    import os

    from gpuforge.prices import load_prices, prices_path
    from gpuforge.settings import current

    if not here and (url or os.environ.get("GPUFORGE_URL")):
        _server_prices(client_for(url, key_file).prices(), as_json)
        return
    path = prices_path(current().home)
    prices = load_prices(path)
    if as_json:
        shown = {n: {"usd_per_hour": p.hourly(), "parts": p.parts(), **p.model_dump(exclude_none=True)}
                 for n, p in prices.items()}  # fmt: skip
        out_console.print(json.dumps(shown), highlight=False, soft_wrap=True, markup=False)
        return
    if not prices:
        out_console.print(f"no prices in {path}: jobs cost what their spec says (cost.usd_per_hour)")
        return
    table = Table("device", "$/hour", "parts")
    for name, price in prices.items():
        parts = ", ".join(f"{part} ${usd:.4f}" for part, usd in price.parts().items())
        table.add_row(name, f"{price.hourly():.4f}", parts)
    out_console.print(table)


def _server_prices(answer: dict, as_json: bool) -> None:
    """A server's prices: a row a device, "no price set" with the command that sets one where none is."""
    import json

    if as_json:
        out_console.print(json.dumps(answer), highlight=False, soft_wrap=True, markup=False)
        return
    table = Table("device", "name", "$/hour", "from", title="the server's prices")
    for d in answer["devices"]:
        priced = d["usd_per_hour"] is not None
        table.add_row(
            d["id"], d["name"], f"{d['usd_per_hour']:.4f}" if priced else "no price set", d["source"] or ""
        )
    out_console.print(table)
    for command in sorted({d["set_price"] for d in answer["devices"] if d["set_price"]}):
        out_console.print(f"no price set: its jobs and replicas are not costed; set one with {command}",
                          highlight=False, markup=False, soft_wrap=True)  # fmt: skip


@prices_app.command("set")
def prices_set(
    device: Annotated[str, typer.Argument(help="a device name as the server lists it, or cuda / cpu")],
    usd_per_hour: Annotated[float | None, typer.Option(help="a rented device: its price an hour")] = None,
    purchase_usd: Annotated[float | None, typer.Option(help="an owned device: what it cost")] = None,
    years: Annotated[float | None, typer.Option(help="years it is written off over")] = None,
    watts: Annotated[float | None, typer.Option(help="power it draws under load")] = None,
    usd_per_kwh: Annotated[float | None, typer.Option(help="what the power costs")] = None,
    utilisation: Annotated[float, typer.Option(help="share of the year it does work")] = 1.0,
) -> None:
    """Price a device: an hourly price, or what an owned one costs (its hourly cost is computed)."""
    from pydantic import ValidationError

    from gpuforge.prices import DevicePrice, load_prices, prices_path, save_prices
    from gpuforge.settings import current
    from gpuforge.spec import format_validation_error

    given = {"usd_per_hour": usd_per_hour, "purchase_usd": purchase_usd, "years": years, "watts": watts,
             "usd_per_kwh": usd_per_kwh}  # fmt: skip
    try:
        price = DevicePrice(**{k: v for k, v in given.items() if v is not None}, utilisation=utilisation)
    except ValidationError as err:
        raise GpuforgeError(format_validation_error(err)) from None
    path = prices_path(current().home)
    prices = load_prices(path)
    prices[device] = price
    save_prices(path, prices)
    parts = ", ".join(f"{part} ${usd:.4f}" for part, usd in price.parts().items())
    out_console.print(f"{device}: ${price.hourly():.4f} an hour ({parts}) in {path}", highlight=False)


@prices_app.command("remove")
def prices_remove(device: Annotated[str, typer.Argument(help="the priced device")]) -> None:
    """Price a device no more."""
    from gpuforge.prices import load_prices, prices_path, save_prices
    from gpuforge.settings import current

    path = prices_path(current().home)
    prices = load_prices(path)
    if prices.pop(device, None) is None:
        raise GpuforgeError(f"{device}: not in {path}")
    save_prices(path, prices)
