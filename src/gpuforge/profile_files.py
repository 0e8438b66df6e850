"""A run's profile files (train/profile.py writes them): their names, reading them back with the slowest
rank beside rank 0, and the request that asks a running job to profile its next steps.

    <run>/profile/profile.json        rank 0's report      profile.rank<R>.json: rank R's
    <run>/profile/trace.json.gz       rank 0's trace       trace.rank<R>.json.gz: rank R's
    <run>/profile.request             {"steps": N}: the runner's main process takes it at its next step
                                      (a look a second at most) and profiles the N steps after it

Shared by the runner, the server (its routes write the request and read the reports), `gpuforge profile`
and `gpuforge dashboard`; light on purpose: no torch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from gpuforge.errors import GpuforgeError
from gpuforge.runs import finite_number, read_run_file
from gpuforge.spec import MAX_PROFILE_STEPS

PROFILE_DIR = "profile"
PROFILE_FILE = "profile.json"
REQUEST_FILE = "profile.request"
MAX_REPORT_BYTES = 8 * 2**20  # a report is a few KiB a step: past this it is no report of ours
_RANK_REPORT = re.compile(r"profile\.rank(\d{1,4})\.json")


class ProfileError(GpuforgeError):
    """A profile file that gpuforge did not write, or that is damaged."""


def report_name(rank: int) -> str:
    return PROFILE_FILE if rank == 0 else f"profile.rank{rank}.json"


def trace_name(rank: int) -> str:
    return "trace.json.gz" if rank == 0 else f"trace.rank{rank}.json.gz"


def trace_path(run_dir: Path, rank: int = 0) -> Path:
    return Path(run_dir) / PROFILE_DIR / trace_name(rank)


def read_profile(run_dir: Path) -> dict[str, Any] | None:
    """Rank 0's report, with `slowest_rank` where the run had several processes: {rank, busy_s,
    mean_step_s, breakdown, trace, ranks}. Every rank's step lasts as long as the slowest's (they wait for
    each other in the all-reduces), so the slowest is the one that waited least: the most busy time, a
    step less its `sync` and gradient all-reduce. Only rank reports of rank 0's window count (a report
    left by an earlier window is not this one's). None where the run has no profile; ProfileError where
    a report is not one gpuforge wrote, or is a link."""
    folder = Path(run_dir) / PROFILE_DIR
    report = _read_report(folder / PROFILE_FILE)
    if report is None:
        return None
    window = [s["step"] for s in report.get("steps", [])]
    ranks = [report]
    for path in sorted(folder.glob("profile.rank*.json")):
        match = _RANK_REPORT.fullmatch(path.name)
        try:
            other = _read_report(path) if match else None
        except ProfileError:
            continue  # another rank's damaged report: rank 0's stands alone
        same = other is not None and [s["step"] for s in other.get("steps", [])] == window
        if same and other.get("rank") == int(match.group(1)):
            ranks.append(other)
    if len(ranks) > 1:
        slowest = max(ranks, key=busy_s)
        report["slowest_rank"] = {
            "rank": slowest.get("rank", 0),
            "busy_s": busy_s(slowest),
            "mean_step_s": slowest["mean_step_s"],
            "breakdown": slowest["breakdown"],
            "trace": trace_name(int(slowest.get("rank", 0))),
            "ranks": len(ranks),
        }
    return report


def busy_s(report: dict[str, Any]) -> float:
    """A rank's mean step less its waits for the others: the step's figures shared (`sync`) and the
    gradient all-reduces, which run until the slowest rank's part arrives."""
    waited = report["breakdown"].get("sync", {}).get("seconds", 0.0)
    waited += (report.get("all_reduce") or {}).get("seconds", 0.0)
    return max(0.0, report["mean_step_s"] - waited)


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        raw = read_run_file(path, MAX_REPORT_BYTES)
    except OSError as err:
        raise ProfileError(f"{path}: cannot be read ({err})") from None
    if raw is None:
        return None
    try:
        report = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProfileError(f"{path}: not a profile gpuforge wrote ({err})") from None
    problem = shape_problem(report)
    if problem:
        raise ProfileError(f"{path}: not a profile gpuforge wrote ({problem})")
    return report


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no figure")  # NaN, Infinity: json.dumps writes them, our reports never


def shape_problem(report: Any) -> str | None:
    """What is wrong with the fields a reader takes from a report, or None."""
    if not isinstance(report, dict):
        return "not a JSON object"
    if not finite_number(report.get("mean_step_s")):
        return "mean_step_s is not a number"
    if not _breakdown(report.get("breakdown")):
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
    if not isinstance(report.get("rank", 0), int):
        return "rank is not a number"
    memory = report.get("memory")
    if memory is not None and not (
        isinstance(memory, dict)
        and (memory.get("peak_bytes") is None or finite_number(memory.get("peak_bytes")))
        and isinstance(memory.get("kept_by", []), list)
        and all(isinstance(k, dict) and finite_number(k.get("bytes", 0)) for k in memory.get("kept_by", []))
    ):
        return "memory is not {peak_bytes, kept_by: [{name, bytes}]}"
    slowest = report.get("slowest_rank")
    if slowest is not None and not (
        isinstance(slowest, dict)
        and finite_number(slowest.get("mean_step_s"))
        and _breakdown(slowest.get("breakdown"))
    ):
        return "slowest_rank lacks its figures"
    return None


def _breakdown(parts: Any) -> bool:
    return isinstance(parts, dict) and all(
        isinstance(p, dict) and finite_number(p.get("seconds")) and finite_number(p.get("share"))
        for p in parts.values()
    )


def ask(run_dir: Path, steps: int) -> None:
    """Ask the run's runner to profile its next `steps` steps (an earlier request not yet taken is
    replaced). Written whole or not at all: the runner never reads half a request."""
    if not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ProfileError(f"steps: {steps} is not between 1 and {MAX_PROFILE_STEPS}")
    target = Path(run_dir) / REQUEST_FILE
    partial = target.with_name(REQUEST_FILE + ".partial")
    partial.write_text(json.dumps({"steps": steps}))
    os.replace(partial, target)


def take_request(run_dir: Path, not_before: float = 0.0) -> int | None:
    """The steps a request asks for, once: the file is moved aside before it is read, so a request
    written meanwhile is the next one, not lost. None where there is none. A request that is not ours
    (damaged, out of bounds), or one written before `not_before` (a Unix time: an earlier attempt's,
    which its runner never took), is removed and is None too."""
    target = Path(run_dir) / REQUEST_FILE
    taken = target.with_name(f"{REQUEST_FILE}.{os.getpid()}.taken")
    try:
        os.replace(target, taken)
    except OSError:  # none
        return None
    try:
        written = taken.stat().st_mtime
        raw = taken.read_bytes()[:256]
        taken.unlink()
        steps = json.loads(raw).get("steps")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    if written < not_before:
        return None
    return (
        steps
        if isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= MAX_PROFILE_STEPS
        else None
    )
