"""The run directory: one job's files, the only thing a training process writes (DESIGN.md, contract).

    <run>/spec.yaml  events.jsonl  metrics.jsonl  summary.json  checkpoints/step-NNNNNN/  model/  logs/

Writers append one JSON object per line and flush it, so a reader (or a crash) sees whole lines only.
summary.json is typed: RunSummary, written by write_summary and read back by read_summary.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict

from gpuforge.errors import RunDirError

SLURM_SCRIPT_PREFIX = "slurm-attempt"  # logs/slurm-attemptN.sh: how the server knows a run's job in squeue
EVENTS = (
    "queued",
    "started",
    "checkpoint",
    "retry",
    "finished",
    "failed",
    "cancelled",
    "paused",
    "compressed",
    "restarted",
    "preempted",  # written by the server once the runner stopped: who preempted it
    "profiled",  # a profile window's report was written (train/profile.py)
    "lr_found",  # train.lr auto: the range test picked the rate (train/lr_find.py)
)


def finite_number(value: Any) -> bool:
    """A JSON figure a job wrote is usable: a number (not a bool), finite, an int within a float's range."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past a float's range
        return False


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All whole lines of a JSON-lines file; a torn last line (killed writer) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


OPTIONAL_KEYS = ("energy_j", "energy_source")  # written only where the run measured them


class RunSummary(BaseModel):
    """<run>/summary.json (contract): a run's final figures, written when its process stops.

    The file holds these keys in this order. `schema_version` is written only from version 2 on: a file
    without it is version 1, as is every file written before the field existed. A newer file's extra keys
    load (and are written back) as they are; the keys added after the first summaries have defaults, so
    older files load too."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    status: str  # finished | failed | cancelled | paused
    reason: str | None  # why it stopped, when not finished; finished: early_stop, stop_at, keep_best said
    steps: int  # optimizer steps done (a failed run: up to the last good one)
    total_steps: int
    resumed_from: int | None  # the checkpoint step this process started from
    samples_per_s: float | None
    tokens_per_s: float | None  # None for images
    median_step_s: float | None
    peak_mem_bytes: int
    final_loss: float | None  # None when failed
    eval: dict[str, float] | None  # loss and accuracy or perplexity of the last evaluation
    device: str
    device_type: str
    precision: str
    precision_reason: str
    batch_size: int  # the micro-batch
    grad_accum: int
    global_batch_size: int
    batch_search: dict[str, Any] | None = None  # how batch_size: auto found the micro-batch
    parameters: int
    trainable_parameters: int
    optimizer_state_bytes: int | None = None
    process_state_bytes: dict[str, int] | None = None  # what one process holds (FSDP: its shards)
    adapter: str | None = None  # lora | qlora-nf4 | qlora-int8
    weight_bytes: int | None = None
    flops_method: str
    device_peak_flops: float
    mfu: float | None
    cost_usd: float
    usd_per_hour: float  # for all the devices the job held
    launch_attempt: str | None = None  # the launcher's attempt id (launch/job.py), for a launched rank
    processes: int = 1
    strategy: str = "none"  # none | ddp | fsdp
    gradient_compression: str | None = None
    comm_bytes_per_step: float | None = None
    wall_s: float
    # what this process measured of its own energy over its logged windows (rank 0's; hardware/energy.py),
    # with the source and rule of the last window: the run's own figure (the server's is the ledger's)
    energy_j: float | None = None
    energy_source: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The file's JSON object (NaN stays NaN here; the writer makes it null)."""
        left_out = {"schema_version"} if self.schema_version == 1 else set()
        left_out |= {k for k in OPTIONAL_KEYS if getattr(self, k) is None}  # absent where not measured
        return self.model_dump(exclude=left_out or None)

    def as_result(self, signal: int | None) -> dict[str, Any]:
        """What `train()` and the launcher return (a RunResult's fields, as a dict)."""
        return {**self.as_dict(), "signal": signal}


class RunResult(RunSummary):
    """How a training process ended: its summary, and the number of the signal that stopped it."""

    signal: int | None = None  # SIGTERM, SIGINT: the exit code is 128 + this


def write_summary(path: Path, summary: RunSummary) -> None:
    write_json_atomic(path, summary.as_dict())


def read_summary(path: Path) -> RunSummary | None:
    """None when there is no summary yet; a ValueError (pydantic's ValidationError) when the file holds
    something else."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return RunSummary.model_validate_json(text)


class RunDir:
    """Paths and writers of one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # paths
    @property
    def spec_path(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def lr_find_path(self) -> Path:
        """train.lr auto: the range test's curve and pick (train/lr_find.py)."""
        return self.root / "lr_find.json"

    @property
    def compressed_dir(self) -> Path:
        """Where the spec's compress section puts its variant (or sweep) and report.json."""
        return self.root / "compressed"

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{step:06d}"

    def slurm_script_path(self, attempt: int) -> Path:
        """The batch script a launch attempt submitted to Slurm (executor slurm)."""
        return self.logs_dir / f"{SLURM_SCRIPT_PREFIX}{attempt}.sh"

    @property
    def slurm_running_path(self) -> Path:
        """When the launcher following this run's Slurm jobs saw them run (launch/slurm.py RunningMarks):
        the server charges the job while one runs, not for its waits in Slurm's queue."""
        return self.logs_dir / "slurm-running"

    def slurm_runs(self) -> SlurmRuns | None:
        """That file read, or None where there is none yet (or it is not one the launcher wrote)."""
        try:
            raw = read_run_file(self.slurm_running_path, SLURM_RUNS_BYTES)
            return SlurmRuns.parse(raw.decode("ascii")) if raw is not None else None
        except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
            return None

    def latest_slurm_script(self) -> Path | None:
        """The batch script written last, where the run was submitted to Slurm (a restarted runner numbers
        its attempts from 0 again: the newest, not the highest number)."""
        written = []
        for path in self.logs_dir.glob(f"{SLURM_SCRIPT_PREFIX}*.sh"):
            try:
                written.append((path.lstat().st_mtime_ns, path.name, path))
            except OSError:
                continue
        return max(written)[2] if written else None

    # checks and creation
    def check_usable(self) -> None:
        """Refuse a path that is a file, or a non-empty directory that is not a gpuforge run."""
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"--out {self.root}: is a file, not a directory")
        # logs/ alone is allowed: the server opens the process log before the runner starts
        if (
            self.root.is_dir()
            and any(p.name != "logs" for p in self.root.iterdir())
            and not self.spec_path.exists()
        ):
            raise RunDirError(f"--out {self.root}: is a non-empty directory that holds no gpuforge run")
        ancestor = self.root.absolute()
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise RunDirError(f"--out {self.root}: {ancestor} is a file, not a directory")
        if not os.access(ancestor, os.W_OK):
            raise RunDirError(f"--out {self.root}: {ancestor} is not writable")

    def create(self) -> None:
        for d in (self.root, self.checkpoints_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)

    # checkpoints
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first (a checkpoint is complete once its meta.json exists)."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for p in self.checkpoints_dir.glob("step-*"):
            if (p / "meta.json").exists():
                try:
                    found.append((int(p.name.removeprefix("step-")), p))
                except ValueError:
                    continue
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    # writers
    def event(self, event: str, **fields: Any) -> None:
        assert event in EVENTS, event
        self._append(self.events_path, {"ts": time.time(), "event": event, **fields})

    def metric(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_path, record)

    def write_summary(self, summary: RunSummary) -> None:
        write_summary(self.summary_path, summary)

    def truncate_metrics_after(self, step: int) -> None:
        """On resume from `step`, drop lines a killed process logged past it: no step counts twice."""
        if not self.metrics_path.exists():
            return
        kept = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in kept))
        os.replace(tmp, self.metrics_path)

    # readers
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def read_summary(self) -> RunSummary | None:
        return read_summary(self.summary_path)

    def summary(self) -> dict[str, Any] | None:
        """The summary as a plain dict, for callers that want one (tests, scripts)."""
        found = self.read_summary()
        return found.as_dict() if found is not None else None

    def readable_summary(self) -> dict[str, Any] | None:
        """The summary as a plain dict for a reader of a run someone else writes (the server, the
        dashboard): None when there is none yet, or when it is torn or not a summary."""
        try:
            return self.summary()
        except ValueError:
            return None

    @staticmethod
    def _append(path: Path, record: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps(_clean(record)) + "\n")
            f.flush()


SLURM_RUNS_KEPT = 100  # runs kept a job (one each time Slurm requeues it) by its runner and by the server
SLURM_RUNS_BYTES = 4096  # SLURM_RUNS_KEPT runs of about 30 characters, and the pid


def first_and_latest(runs: list, kept: int = SLURM_RUNS_KEPT) -> list:
    """The first run (max_time counts from it) and the latest kept - 1: a ledger's mark is past the rest."""
    return runs if len(runs) <= kept else [runs[0], *runs[-(kept - 1) :]]


@dataclass(frozen=True)
class SlurmRuns:
    """What the launcher following a run's Slurm jobs saw: its pid (the server's job.pid: a file another
    runner wrote is not this one's), and each time a job ran, as (start, end) Unix times on its clock (the
    server's machine's), the last one's end None while it runs. Written `PID START:END ... START:`."""

    runner_pid: int
    runs: tuple[tuple[float, float | None], ...]

    @classmethod
    def parse(cls, text: str) -> SlurmRuns:
        """ValueError where `text` is not what RunningMarks writes: times finite, in order, only the last
        run open."""
        pid, *fields = text.split()
        runs: list[tuple[float, float | None]] = []
        for field in fields:
            began, colon, ended = field.partition(":")
            run = (float(began), float(ended) if ended else None)
            if not colon or not all(math.isfinite(t) for t in run if t is not None):
                raise ValueError(f"not a run: {field!r}")
            after = runs[-1][1] if runs else -math.inf  # the run before must have ended before this began
            if after is None or after > run[0] or (run[1] is not None and run[1] < run[0]):
                raise ValueError(f"a run out of order: {field!r}")
            runs.append(run)
        if not runs:
            raise ValueError("no run")
        return cls(int(pid), tuple(runs))

    def text(self) -> str:
        """The form `parse` reads."""
        spans = " ".join(f"{start:.3f}:{'' if end is None else f'{end:.3f}'}" for start, end in self.runs)
        return f"{self.runner_pid} {spans}\n"


def open_run_file(path: Path) -> BinaryIO | None:
    """A file a runner wrote, opened to read (binary): None where there is none; OSError saying why where
    it or its folder is a link (never followed out of the run), or it is not a plain file (opening a FIFO
    would hang the reader). Every reader of a run's files opens them here: they are untrusted input."""
    if path.parent.is_symlink():
        raise OSError(f"{path.parent.name}/ is a link, not a folder gpuforge made")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        why = "a link, not a file gpuforge wrote" if err.errno == errno.ELOOP else err.strerror
        raise OSError(why) from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise OSError("not a plain file")
    return f


def read_run_file(path: Path, limit: int) -> bytes | None:
    """A file a runner wrote, whole, for a reader that serves it (the server, the dashboard): None where
    there is none; OSError saying why where open_run_file refuses it, or it is over `limit` bytes."""
    f = open_run_file(path)
    if f is None:
        return None
    with f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise OSError(f"over {limit} bytes")
    return raw


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2) + "\n")
    os.replace(tmp, path)


class ReaderRunDir(RunDir):
    """The run directory as every rank but 0 of a distributed job sees it: read, never written. Rank 0
    writes the events, metrics, summary and checkpoints for all of them."""

    def create(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)  # for this rank's own log file

    def event(self, event: str, **fields: Any) -> None:
        pass

    def metric(self, record: dict[str, Any]) -> None:
        pass

    def write_summary(self, summary: RunSummary) -> None:
        pass

    def truncate_metrics_after(self, step: int) -> None:
        pass
