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
    """Rank 0's report, with `slowest_rank` where the run had several processes: the rank whose mean step
    was the longest (rank 0 itself, or another: {rank, mean_step_s, breakdown, trace}). None where the run
    has no profile; ProfileError where a report is not one gpuforge wrote."""
    folder = Path(run_dir) / PROFILE_DIR
    report = _read_report(folder / PROFILE_FILE)
    if report is None:
        return None
    ranks = [report]
    for path in sorted(folder.glob("profile.rank*.json")):
        match = _RANK_REPORT.fullmatch(path.name)
        other = _read_report(path) if match else None
        if other is not None and other.get("rank") == int(match.group(1)):
            ranks.append(other)
    if len(ranks) > 1:
        slowest = max(ranks, key=lambda r: r["mean_step_s"])
        report["slowest_rank"] = {
            "rank": slowest.get("rank", 0),
            "mean_step_s": slowest["mean_step_s"],
            "breakdown": slowest["breakdown"],
            "trace": trace_name(int(slowest.get("rank", 0))),
            "ranks": len(ranks),
        }
    return report


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ProfileError(f"{path}: cannot be read ({err.strerror})") from None
    if len(raw) > MAX_REPORT_BYTES:
        raise ProfileError(f"{path}: over {MAX_REPORT_BYTES // 2**20} MiB, not a profile gpuforge wrote")
    try:
        report = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProfileError(f"{path}: not a profile gpuforge wrote ({err})") from None
    problem = shape_problem(report)
    if problem:
        raise ProfileError(f"{path}: not a profile gpuforge wrote ({problem})")
    return report


def shape_problem(report: Any) -> str | None:
    """What is wrong with the fields a reader takes from a report, or None."""
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
    if not isinstance(report.get("rank", 0), int):
        return "rank is not a number"
    return None


def ask(run_dir: Path, steps: int) -> None:
    """Ask the run's runner to profile its next `steps` steps (an earlier request not yet taken is
    replaced). Written whole or not at all: the runner never reads half a request."""
    if not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ProfileError(f"steps: {steps} is not between 1 and {MAX_PROFILE_STEPS}")
    target = Path(run_dir) / REQUEST_FILE
    partial = target.with_name(REQUEST_FILE + ".partial")
    partial.write_text(json.dumps({"steps": steps}))
    os.replace(partial, target)


def take_request(run_dir: Path) -> int | None:
    """The steps a request asks for, once: the file is removed as it is read. None where there is none;
    a request that is not ours (damaged, out of bounds) is removed and is None too."""
    target = Path(run_dir) / REQUEST_FILE
    try:
        raw = target.read_bytes()[:256]
        target.unlink()
    except OSError:  # none (or taken meanwhile)
        return None
    try:
        steps = json.loads(raw).get("steps")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return steps if isinstance(steps, int) and 1 <= steps <= MAX_PROFILE_STEPS else None
