"""A profile of a few training steps (train.profile, `gpuforge train SPEC --profile 10:5`): torch.profiler
records them, and the phases gpuforge marks (runtime/phases.py) split each step's time.

    <run>/profile/trace.json.gz    the trace (Chrome / Perfetto JSON, gzipped; each rank's own under DDP)
    <run>/profile/profile.json     the mean step's breakdown, the top operators, the memory peak, advice

Off (no train.profile), no profiler is created: the engine's Profiling holds NO_PROFILE, whose step() is
one shared no-op context. On, at most the asked steps are recorded, and a trace past TRACE_LIMIT bytes is
cut, with a note in profile.json. A running job is asked for a window by a request file (a server's
`gpuforge profile JOB --steps N`: profile_files.py), which the main process looks for at most once a
second. `gpuforge profile RUN_DIR` prints the breakdown (cli/).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpuforge.hardware.probe import peak_memory_bytes
from gpuforge.profile_files import PROFILE_DIR, report_name, take_request, trace_name
from gpuforge.runtime.phases import PHASES, PhaseClock, timing

log = logging.getLogger("gpuforge.train")

REQUEST_LOOK_S = 1.0  # the main process looks for a request file at most this often (a stat, not each step)
TRACE_LIMIT = 200 * 2**20  # bytes of trace JSON kept; past it the trace is cut
TOP_OPERATORS = 20
OTHER = "other"  # the step's time outside every marked phase: host work between them, syncs


class _NoProfile:
    """What the engine holds when no profile is asked for."""

    _nothing = contextlib.nullcontext()
    recording, finished = False, True

    def step(self, step: int):
        return self._nothing

    def note_comm(self, comm: dict[str, int]) -> None:
        pass

    def note_failed(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROFILE = _NoProfile()


def step_profiler(
    options, root: Path, device: torch.device, rank: int, context: dict[str, Any], steps: range, written=None
):
    """The spec's train.profile as a StepProfiler, or NO_PROFILE when it asks for none. `steps`: the steps
    this run will take (a window outside them is said at once, not left to an empty profile/)."""
    if options is None:
        return NO_PROFILE
    last = options.start_step + options.steps - 1
    if options.start_step > steps.stop - 1 or last < steps.start:
        log.warning(
            "train.profile: steps %d to %d are not among this run's (%d to %d): nothing is recorded",
            options.start_step, last, steps.start, steps.stop - 1,
        )  # fmt: skip
        return NO_PROFILE
    folder = Path(root) / PROFILE_DIR
    return StepProfiler(
        options.start_step, options.steps, folder, device, rank, context, written, options.stacks
    )


class Profiling:
    """The run's profile windows: train.profile's, then each one asked for while the run goes on (a
    request file, taken by the main process: `asked()`; every process opens the window the step's
    all-reduce agreed on: `open()`). One window at a time: a request is left waiting while one records,
    and one asked for before train.profile's window starts runs first, that window after it."""

    def __init__(self, window, make_window, requests_in: Path | None, not_before: float = 0.0):
        self.window = window  # a StepProfiler, or NO_PROFILE
        self._waiting = None  # train.profile's window, put off while an asked one records
        self._make = make_window  # (first step, steps) -> StepProfiler
        self._requests_in = requests_in  # the run directory, on the main process; None on the others
        self._not_before = not_before  # a request older than this attempt is an earlier one's: dropped
        self._next_look = 0.0

    def step(self, step: int):
        if self._waiting is not None and self.window.finished:
            self.window, self._waiting = self._waiting, None
        return self.window.step(step)

    def note_comm(self, comm: dict[str, int]) -> None:
        self.window.note_comm(comm)

    def note_failed(self) -> None:
        self.window.note_failed()

    def close(self) -> None:
        self.window.close()

    def asked(self) -> int:
        """The steps a request asks to profile, 0 for none: on the main process, a look a second at most,
        and none while a window records (the request waits for its end)."""
        if self._requests_in is None or self.window.recording:
            return 0
        now = time.monotonic()
        if now < self._next_look:
            return 0
        self._next_look = now + REQUEST_LOOK_S
        return take_request(self._requests_in, self._not_before) or 0

    def open(self, first: int, steps: int, last_step: int) -> None:
        """A window of `steps` steps from `first` (cut at the run's last step), as a request asked; every
        process calls it at the same step, with the same window in hand."""
        if first > last_step:
            log.warning("a profile request for %d steps came at the last step: nothing is recorded", steps)
            return
        if self.window.recording:  # not taken while one records (asked()): another process's request
            log.warning("a profile request for %d steps is turned down: steps %d to %d are being recorded",
                        steps, self.window.first, self.window.last)  # fmt: skip
            return
        if not self.window.finished and self._waiting is None and self.window is not NO_PROFILE:
            self._waiting = self.window  # train.profile's, not started yet: after this one
        self.window = self._make(first, min(steps, last_step - first + 1))


class StepProfiler:
    """Steps start_step .. start_step + steps - 1 under torch.profiler, each step's phases timed. The files
    are written after the last one, or at close() when the run ends inside the window (what was recorded)."""

    def __init__(
        self,
        first: int,
        count: int,
        folder: Path,
        device: torch.device,
        rank: int,
        context,
        written=None,
        stacks: bool = False,
    ):
        self.first, self.last, self.folder = first, first + count - 1, folder
        self.device, self.rank, self.context = device, rank, dict(context)
        self.written = written  # called with the report's figures once written (the main process's event)
        self.stacks = stacks  # Python call stacks in the trace (train.profile.stacks)
        self.steps: list[dict[str, Any]] = []
        self.comm_bytes = 0
        self._profiler: torch.profiler.profile | None = None
        self._done = False
        self._failed = False

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self._done or not self.first <= step <= self.last:
            yield
            return
        if self._profiler is None:
            self._start()
        clock = PhaseClock(self.device)
        clock.synchronize()
        began = time.perf_counter()
        with timing(clock), torch.profiler.record_function("gpuforge.step"):
            yield  # an exception here ends the window: the engine's close() writes what was recorded
        clock.synchronize()
        if self._failed:  # a step that failed (NaN loss, OOM at a micro-batch of 1) made no update
            self._failed = False
            self.close()
            return
        seconds = time.perf_counter() - began
        self.steps.append({"step": step, "seconds": seconds, "phases": dict(clock.seconds)})
        if step == self.last:
            self._finish(cut_short=False)

    @property
    def recording(self) -> bool:
        """Whether the window has started and is not written yet."""
        return self._profiler is not None and not self._done

    @property
    def finished(self) -> bool:
        """Whether the window was written (or closed): it records nothing more."""
        return self._done

    def note_comm(self, comm: dict[str, int]) -> None:
        """The all-reduce bytes of a recorded step (Parallel.pop_comm's figures)."""
        if self._profiler is not None and not self._done:
            self.comm_bytes += int(comm.get("comm_bytes", 0))

    def note_failed(self) -> None:
        """The step under way failed: it is left out, and the window ends with the run."""
        self._failed = True

    def close(self) -> None:
        """The run ended (or failed) inside the window: what was recorded is written, and the profiler
        is stopped whatever happens."""
        if self._profiler is not None and not self._done:
            self._finish(cut_short=True)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            profile_memory=True,
            with_stack=self.stacks,
        )
        self._profiler.__enter__()
        log.info("profiling steps %d to %d into %s", self.first, self.last, self.folder)

    def _finish(self, cut_short: bool) -> None:
        """Stop the profiler and write the files. A profile that cannot be written (a full disk) is a
        warning: the training goes on."""
        self._done = True
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        if not self.steps:
            log.warning("train.profile: no step was recorded whole; nothing is written")
            return
        try:
            figures = self._write(profiler, cut_short)
            if self.written is not None:
                self.written(**figures)
        except Exception as err:  # noqa: BLE001 (the run matters more than its profile)
            log.warning("train.profile: the profile could not be written into %s: %s", self.folder, err)

    def _write(self, profiler, cut_short: bool) -> dict[str, Any]:
        """Write the trace and the report; what the `profiled` event says of them."""
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = trace_name(self.rank)
        trace_note = _write_trace(profiler, self.folder / trace)
        averages, steps = profiler.key_averages(), len(self.steps)
        report = breakdown(self.steps, self.device)
        report.update(
            rank=self.rank,
            asked={"start_step": self.first, "steps": self.last - self.first + 1},
            cut_short=cut_short,
            trace=trace,
            trace_note=trace_note,
            top_operators=top_operators(averages, self.device, steps),
            memory=_memory(averages, self.device, steps),
            all_reduce=_all_reduce(profiler.events(), report, self.comm_bytes, self.context),
            context=self.context,
        )
        report["advice"] = advice(report)
        name = report_name(self.rank)
        partial = self.folder / f"{name}.partial"
        partial.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(partial, self.folder / name)
        log.info("profile of %d steps written to %s", steps, self.folder / name)
        top, part = max(report["breakdown"].items(), key=lambda kv: kv[1]["share"])
        return {
            "start_step": self.steps[0]["step"], "steps": steps, "mean_step_s": report["mean_step_s"],
            "top": f"{top} {part['share']:.0%}", "cut_short": cut_short, "path": f"{PROFILE_DIR}/{name}",
        }  # fmt: skip


def breakdown(steps: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The mean recorded step, split into its phases (seconds and shares); what no phase covers is OTHER."""
    mean = statistics.fmean(s["seconds"] for s in steps) if steps else 0.0
    parts = {name: statistics.fmean(s["phases"].get(name, 0.0) for s in steps) if steps else 0.0
             for name in PHASES}  # fmt: skip
    parts[OTHER] = max(0.0, mean - sum(parts.values()))
    return {
        "device": device.type,
        "steps": steps,
        "mean_step_s": mean,
        "breakdown": {name: {"seconds": s, "share": s / mean if mean else 0.0} for name, s in parts.items()},
    }


def top_operators(averages, device: torch.device, steps: int, count: int = TOP_OPERATORS) -> list[dict]:
    """The operators with the most self time in a mean step (the device's on a GPU, else the CPU's), calls
    a step too. Only operators: gpuforge's phase ranges and other annotations (which span their whole
    contents) are left out, and so are Python's frames and the kernels' own rows, whose time each
    operator's row holds."""
    on_device = device.type == "cuda"
    rows = []
    for event in averages:
        if event.key.startswith(("gpuforge.", "ProfilerStep")) or getattr(event, "is_user_annotation", False):
            continue
        if _is_python_frame(event.key):
            continue
        if getattr(event, "device_type", torch.autograd.DeviceType.CPU) != torch.autograd.DeviceType.CPU:
            continue
        cpu = event.self_cpu_time_total / 1e6 / steps
        gpu = getattr(event, "self_device_time_total", 0.0) / 1e6 / steps
        calls = event.count / steps
        rows.append({"name": event.key, "calls": calls, "self_cpu_s": cpu, "self_device_s": gpu})
    rows.sort(key=lambda r: r["self_device_s" if on_device else "self_cpu_s"], reverse=True)
    total = sum(r["self_device_s" if on_device else "self_cpu_s"] for r in rows) or 1.0
    for row in rows:
        row["share"] = row["self_device_s" if on_device else "self_cpu_s"] / total
    return rows[:count]


# with_stack's Python frames, as torch names them: "path.py(12): name", or "<built-in method x of y>"
_PYTHON_FRAME = re.compile(r"^(<built-in |[^()]*\(\d+\): )")


def _is_python_frame(key: str) -> bool:
    return bool(_PYTHON_FRAME.match(key))


def _memory(averages, device: torch.device, steps: int) -> dict[str, Any]:
    """The run's peak so far (the allocator's on a GPU, the process's resident memory on a CPU: the
    run's own figure, which a profile does not reset) and the operators whose allocations, net of what
    they freed, kept the most a mean step."""
    field = "self_device_memory_usage" if device.type == "cuda" else "self_cpu_memory_usage"
    kept = sorted(
        (
            (event.key, int(getattr(event, field, 0) or 0) // steps)
            for event in averages
            if not _is_python_frame(event.key)
        ),  # fmt: skip
        key=lambda kv: kv[1],
        reverse=True,
    )
    return {
        "peak_bytes": peak_memory_bytes(device),
        "peak_is": "allocated, since the run began" if device.type == "cuda" else "resident, the process's",
        "kept_by": [{"name": name, "bytes": size} for name, size in kept[:5] if size > 0],
    }


def _all_reduce(events, report: dict[str, Any], comm_bytes: int, context: dict) -> dict[str, Any] | None:
    """The gradient all-reduces' time a mean step (gloo's or NCCL's own ranges, from the start of the work
    to its end, waiting for the slowest rank included; they overlap backward), their bytes and the
    bandwidth reached; None with one process. The step's figures, shared in the `sync` phase, are left
    out: an all-reduce that starts inside a gpuforge.sync range is theirs. Under FSDP the gathers and scatters
    are not counted (`counted` says so)."""
    if context.get("processes", 1) < 2:
        return None
    syncs = [e.time_range for e in events if e.name == "gpuforge.sync"]
    seconds = 0.0
    for event in events:
        if not event.name.startswith(("gloo:all_reduce", "nccl:all_reduce")):
            continue
        span = event.time_range
        # the step's figures' own all-reduce starts inside `sync`; a gradient bucket's starts in backward
        # and may run on into `sync` while a slower rank's part is awaited: it stays counted
        if any(sync.start <= span.start < sync.end for sync in syncs):
            continue
        seconds += (span.end - span.start) / 1e6
    steps = max(1, len(report["steps"]))
    mean_s, mean_bytes = seconds / steps, comm_bytes // steps
    return {
        "seconds": mean_s,
        "share": mean_s / report["mean_step_s"] if report["mean_step_s"] else 0.0,
        "bytes": mean_bytes,
        "bandwidth_bytes_per_s": mean_bytes / mean_s if mean_s and mean_bytes else None,
        "counted": "DDP's gradient all-reduces" if context.get("strategy") == "ddp" else "not counted (FSDP)",
    }


def _write_trace(profiler, target: Path) -> str | None:
    """The Chrome trace, gzipped; cut to its first TRACE_LIMIT bytes of events (and said so) when longer."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        raw = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        size, note = raw.stat().st_size, None
        if size > TRACE_LIMIT:
            trace = json.loads(raw.read_text())
            events = trace.get("traceEvents", [])
            kept = events[: max(1, int(len(events) * TRACE_LIMIT / size))]
            trace["traceEvents"] = kept
            raw.write_text(json.dumps(trace))
            note = (
                f"the trace was {size / 2**20:.0f} MB, past the {TRACE_LIMIT / 2**20:.0f} MB kept: its first "
                f"{len(kept)} of {len(events)} events are kept; profile fewer steps for all of them"
            )
        partial = target.with_name(target.name + ".partial")
        with raw.open("rb") as src, gzip.open(partial, "wb", compresslevel=6) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, target)
    return note


# --- advice: one line where a share is out of line and gpuforge has a lever for it ---------------------

ADVICE_RULES = (
    # (part, share at least, the line; {share} and the context's fields are filled in)
    ("optimizer", 0.25, "optimizer {share:.0%} with {trainable_m:.1f} M trainable parameters: model.lora "
                        "trains a small adapter instead, with a far smaller optimizer step"),
    (OTHER, 0.30, "{share:.0%} of the step outside the model's phases (host work between kernels): "
                  "train.compile fuses them"),
    ("evaluation", 0.25, "evaluation {share:.0%} of the step: evaluate less often "
                         "(train.eval_every is {eval_every})"),
    ("checkpoint", 0.25, "checkpoints {share:.0%} of the step: save less often (train.checkpoint_every)"),
    ("logging", 0.15, "logging {share:.0%} of the step: log less often (train.log_every)"),
    ("data_wait", 0.30, "data wait {share:.0%}: batches are built on the training thread; shorter "
                        "data.max_length pads less"),
)  # fmt: skip


def advice(report: dict[str, Any]) -> list[str]:
    """The advice lines for a profile report, each where its lever is not pulled already."""
    context, lines = report.get("context", {}), []
    for part, floor, line in ADVICE_RULES:
        share = report["breakdown"].get(part, {}).get("share", 0.0)
        if share < floor:
            continue
        if part == "optimizer" and context.get("lora"):
            continue
        if part == OTHER and (context.get("compile") or context.get("processes", 1) > 1):
            continue  # compiled already, or several processes (train.compile does not go with them yet)
        if part == "evaluation" and not context.get("eval_every"):
            continue  # the run's last step evaluates once in any case: that is not a lever
        trainable_m = context.get("trainable_params", 0) / 1e6
        lines.append(line.format(share=share, trainable_m=trainable_m, eval_every=context.get("eval_every")))
    comm = report.get("all_reduce")
    compressed = context.get("gradient_compression", "none") != "none"
    if comm and comm["share"] >= 0.4 and comm["bytes"] and not compressed:
        speed = comm.get("bandwidth_bytes_per_s")
        over = f" over {speed * 8 / 1e6:.0f} Mbit/s" if speed else ""
        lines.append(
            f"all-reduce {comm['share']:.0%}{over}: distributed.gradient_compression: powersgd sends a "
            "fraction of the bytes"
        )
    return lines
