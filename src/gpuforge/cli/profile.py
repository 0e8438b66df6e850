"""`gpuforge profile RUN_DIR`: where a profiled run's step time goes (train.profile, or
`gpuforge train SPEC --profile START:STEPS`), as a table with advice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gpuforge.cli.app import app, out_console
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
    run_dir: Annotated[Path, typer.Argument(help="a run directory that was profiled")],
    as_json: Annotated[bool, typer.Option("--json", help="print profile.json as it is")] = False,
) -> None:
    """Where a profiled run's step time goes: the mean step's parts, the top operators, advice."""
    from gpuforge.train.profile import PROFILE_DIR, PROFILE_FILE

    path = run_dir / PROFILE_DIR / PROFILE_FILE
    if not path.is_file():
        raise GpuforgeError(
            f"{run_dir}: no {PROFILE_DIR}/{PROFILE_FILE}; train with --profile START:STEPS (or train.profile "
            "in the spec) to record one"
        )
    try:
        report = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise GpuforgeError(f"{path}: not a profile gpuforge wrote ({err})") from None
    problem = _shape_problem(report)
    if problem:
        raise GpuforgeError(f"{path}: not a profile gpuforge wrote ({problem})")
    parts = report["breakdown"]
    if as_json:
        out_console.print_json(json.dumps(report))
        return
    out_console.print(_breakdown_table(report, parts))
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
    trace = run_dir / PROFILE_DIR / str(report.get("trace") or "")
    out_console.print(f"trace: {trace} (Perfetto, chrome://tracing)", highlight=False, markup=False)


def _shape_problem(report) -> str | None:
    """What is wrong with the fields the table reads, or None."""
    if not isinstance(report, dict):
        return "not a JSON object"
    if not isinstance(report.get("mean_step_s"), int | float):
        return "mean_step_s is not a number"
    parts = report.get("breakdown")
    figures = ("seconds", "share")
    if not isinstance(parts, dict) or not all(
        isinstance(p, dict) and all(isinstance(p.get(k), int | float) for k in figures)
        for p in parts.values()
    ):
        return "breakdown is not {part: {seconds, share}}"
    if not isinstance(report.get("steps", []), list) or not isinstance(report.get("top_operators", []), list):
        return "steps or top_operators is not a list"
    if not all(isinstance(step, dict) and "step" in step for step in report.get("steps", [])):
        return "a steps row lacks its step"
    for row in report.get("top_operators", []):
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), int | float) for k in ("calls", "self_cpu_s", "self_device_s", "share")
        ):
            return "a top_operators row lacks its figures"
    comm = report.get("all_reduce")
    if comm is not None and not (
        isinstance(comm, dict)
        and all(isinstance(comm.get(k), int | float) for k in ("seconds", "share", "bytes"))
    ):
        return "all_reduce lacks its figures"
    if not all(isinstance(line, str) for line in report.get("advice") or []):
        return "advice is not a list of lines"
    return None


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
