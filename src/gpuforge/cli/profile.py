"""`gpuforge profile RUN_DIR | JOB`: where a profiled run's step time goes (train.profile, `gpuforge train
SPEC --profile START:STEPS`, or `gpuforge profile JOB --steps N` for a running server job), as a table with
advice, and the slowest rank's breakdown beside rank 0's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gpuforge.cli.app import app, out_console
from gpuforge.cli.server import KeyFile, Url, client_for
from gpuforge.errors import GpuforgeError

ProfileSteps = Annotated[
    str | None,
    typer.Option("--profile", help="START:STEPS, e.g. 10:5: record those steps (train.profile)"),
]


def profile_overrides(text: str | None) -> list[str]:
    """`--profile 10:5` as the spec's fields (train.profile.start_step, .steps)."""
    if text is None:
        return []
    start, sep, steps = text.partition(":")
    if not sep or not start.strip().isdigit() or not steps.strip().isdigit():
        raise GpuforgeError(f"--profile {text}: expected START:STEPS, e.g. 10:5 (steps 10 to 14)")
    return [f"train.profile.start_step={int(start)}", f"train.profile.steps={int(steps)}"]


@app.command()
def profile(
    target: Annotated[str, typer.Argument(help="a profiled run directory, or a server job's id")],
    steps: Annotated[
        int | None,
        typer.Option("--steps", min=1, help="a running server job: profile its next N steps (at most 50)"),
    ] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="a server job: save its trace (gzipped JSON) to this file")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print profile.json as it is")] = False,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """Where a profiled run's step time goes: the mean step's parts, the top operators, advice. A job id
    reads it from the server; with --steps, a running job profiles its next steps."""
    from gpuforge.profile_files import PROFILE_DIR, shape_problem
    from gpuforge.spec import MAX_PROFILE_STEPS  # here: pydantic, which the CLI's start does without

    if steps is not None and steps > MAX_PROFILE_STEPS:
        raise GpuforgeError(f"--steps {steps}: at most {MAX_PROFILE_STEPS} steps are profiled")
    run_dir = Path(target)
    server_job = target.isdigit() and (steps is not None or trace is not None or not run_dir.is_dir())
    if not server_job:  # a run directory (a folder named with digits: write ./7 to mean it with --steps)
        if steps is not None or trace is not None:
            raise GpuforgeError(
                f"--steps and --trace are for a server job's id, not a run directory ({target}); here, "
                "train with --profile START:STEPS"
            )
        report = _local(run_dir)
        trace_at = str(run_dir / PROFILE_DIR / str(report.get("trace") or ""))
    else:
        job_id, client = int(target), client_for(url, key_file)
        if steps is not None:
            client.ask_profile(job_id, steps)
            out_console.print(
                f"job {job_id}: its runner profiles the {steps} steps after the one under way (it looks for "
                f"the request once a second); then: gpuforge profile {job_id}",
                highlight=False, markup=False,
            )  # fmt: skip
            return
        report = client.profile(job_id)
        problem = shape_problem(report)
        if problem:
            raise GpuforgeError(f"job {job_id}: the server's profile is not one gpuforge wrote ({problem})")
        if trace is not None:
            client.profile_trace(job_id, trace)
        trace_at = str(trace) if trace is not None else f"gpuforge profile {job_id} --trace FILE"
    if as_json:
        out_console.print_json(json.dumps(report))
        return
    _print_report(report, trace_at)


def _local(run_dir: Path) -> dict:
    from gpuforge.profile_files import PROFILE_DIR, PROFILE_FILE, ProfileError, read_profile

    try:
        report = read_profile(run_dir)
    except ProfileError as err:
        raise GpuforgeError(str(err)) from None
    if report is None:
        raise GpuforgeError(
            f"{run_dir}: no {PROFILE_DIR}/{PROFILE_FILE}; train with --profile START:STEPS (or train.profile "
            "in the spec) to record one"
        )
    return report


def _print_report(report: dict, trace_at: str) -> None:
    out_console.print(_breakdown_table(report, report["breakdown"]))
    slowest = report.get("slowest_rank")
    if slowest and slowest.get("rank") != report.get("rank", 0):
        out_console.print(_slowest_table(report, slowest))
    elif slowest:
        out_console.print(f"rank 0 is the slowest of {slowest.get('ranks')} processes", highlight=False)
    out_console.print(_operators_table(report.get("top_operators", [])[:10], report.get("device")))
    memory = report.get("memory") or {}
    if isinstance(memory.get("peak_bytes"), int | float):
        kept = ", ".join(
            f"{h.get('name')} {h.get('bytes', 0) / 2**20:.1f} MiB" for h in (memory.get("kept_by") or [])[:3]
        )
        out_console.print(
            f"memory peak {memory['peak_bytes'] / 2**30:.2f} GiB ({memory.get('peak_is', '')})"
            + (f"; kept a step (allocated, net of frees) by {kept}" if kept else ""),
            highlight=False,
            markup=False,
        )
    for line in report.get("advice", []):
        out_console.print(f"advice: {line}", highlight=False, markup=False)
    if not report.get("advice"):
        out_console.print("advice: none (no share is out of line)", highlight=False, markup=False)
    notes = [report.get("trace_note"), "the run ended inside the window" if report.get("cut_short") else None]
    for note in filter(None, notes):
        out_console.print(f"note: {note}", highlight=False, markup=False)
    out_console.print(f"trace: {trace_at} (Perfetto, chrome://tracing)", highlight=False, markup=False)


def _slowest_table(report: dict, slowest: dict) -> Table:
    """Rank 0's parts beside the slowest rank's."""
    other = slowest["rank"]
    table = Table(
        title=f"the slowest rank, {other}: {slowest['mean_step_s'] * 1000:.1f} ms a step "
        f"(rank 0: {report['mean_step_s'] * 1000:.1f})"
    )
    for column in ("part", "rank 0 ms", "share", f"rank {other} ms", "share "):
        table.add_column(column, justify="left" if column == "part" else "right")
    mine, theirs = report["breakdown"], slowest["breakdown"]
    for name in sorted(theirs, key=lambda n: theirs[n]["share"], reverse=True):
        ours = mine.get(name, {"seconds": 0.0, "share": 0.0})
        if theirs[name]["seconds"] <= 0 and ours["seconds"] <= 0:
            continue
        figures = [f"{p['seconds'] * 1000:.2f}" if i == 0 else f"{p['share']:.1%}"
                   for p in (ours, theirs[name]) for i in (0, 1)]  # fmt: skip
        table.add_row(escape(name.replace("_", " ")), *figures)
    return table


def _breakdown_table(report: dict, parts: dict) -> Table:
    steps = report.get("steps", [])
    first = steps[0]["step"] if steps else "?"
    title = (
        f"mean step {report['mean_step_s'] * 1000:.1f} ms over {len(steps)} steps from step {first} "
        f"({report.get('device', '?')})"
    )
    table = Table(title=title)
    for column in ("part", "ms", "share", ""):
        table.add_column(column, justify="left" if column in ("part", "") else "right")
    for name, part in sorted(parts.items(), key=lambda kv: kv[1]["share"], reverse=True):
        if part["seconds"] <= 0:
            continue
        bar = "#" * round(part["share"] * 30)
        table.add_row(
            escape(name.replace("_", " ")), f"{part['seconds'] * 1000:.2f}", f"{part['share']:.1%}", bar
        )
    comm = report.get("all_reduce")
    if comm:
        speed = comm.get("bandwidth_bytes_per_s")
        rate = f", {speed * 8 / 1e6:.0f} Mbit/s" if speed else ""
        table.add_row(
            "all-reduce (overlaps backward)", f"{comm['seconds'] * 1000:.2f}", f"{comm['share']:.1%}",
            f"{comm['bytes'] / 2**10:,.0f} KiB{rate}",
        )  # fmt: skip
    return table


def _operators_table(rows: list[dict], device: str | None) -> Table:
    on_device = device == "cuda"
    table = Table(title=f"operators with the most self time in a mean step ({'GPU' if on_device else 'CPU'})")
    for column in ("operator", "calls a step", "ms", "share"):
        table.add_column(column, justify="left" if column == "operator" else "right")
    for row in rows:
        seconds = row["self_device_s"] if on_device else row["self_cpu_s"]
        table.add_row(
            escape(str(row.get("name"))), f"{row['calls']:g}", f"{seconds * 1000:.2f}", f"{row['share']:.1%}"
        )
    return table
