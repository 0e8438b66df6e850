"""The Slurm executor: each job's ranks run as one Slurm job (launch/slurm.py) on a partition whose nodes,
read again while the server serves (drained, down, added), are the devices handed out.

A Slurm job may wait in Slurm's queue after its runner starts, so a job is charged only while its Slurm
jobs ran, and its max_time counts from when they first ran: as its runner wrote (runs.SlurmRuns) and as
the server saw itself (slurm_holding.py, squeue), together.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuforge.executors.base import RunnerHere
from gpuforge.executors.slurm_holding import SeenHolding, union
from gpuforge.runs import RunDir
from gpuforge.scheduler.allocator import DeviceInfo, cluster_inventory
from gpuforge.scheduler.executor import RunningRow
from gpuforge.store.ledger import Span
from gpuforge.store.models import Job, utcnow

if TYPE_CHECKING:
    from gpuforge.spec import JobSpec

log = logging.getLogger("gpuforge.server")


def _holding_now() -> set[str] | None:
    from gpuforge.launch.slurm import holding_logs_folders

    return holding_logs_folders()


class SlurmExecutor(RunnerHere):
    """`options`: the partition, account and QOS given ({"partition": ...}, those set); `runs_dir` and
    `home`: the server's, for the probe at `check` (the runner side needs neither)."""

    rereads_devices = True
    launches_ranks = True

    def __init__(
        self,
        options: dict[str, str],
        labels: str = "",
        runs_dir: Path | None = None,
        home: Path | None = None,
        holding_source: Callable[[], set[str] | None] = _holding_now,
    ):
        super().__init__(labels)
        self.options, self.runs_dir, self.home = options, runs_dir, home
        self.seen_holding = SeenHolding(holding_source)  # what the server saw itself: no file hides it
        self.runs: dict[int, list[Span]] = {}  # running job -> its Slurm runs, as of take_stock

    def check(self) -> None:
        """The partition has nodes, and a probe job on one of them wrote into the run directory. A probe
        that passed is remembered in the home for the same directory and Slurm options: a restart does
        not wait again for a free node of a busy partition."""
        from gpuforge.launch.slurm import check_slurm
        from gpuforge.launch.slurm_partition import partition_name, partition_nodes, probe_shared

        assert self.runs_dir is not None and self.home is not None, "the server's executor has both"
        check_slurm(dict(self.options))  # commands on PATH, names that are names, before any is run
        nodes = partition_nodes(self.options.get("partition"))
        # what the probe showed holds for this directory, on these nodes (the default partition may change)
        asked = {
            "runs_dir": str(self.runs_dir.resolve()),
            **self.options,
            "partition": partition_name(self.options.get("partition")),
            "cluster": os.environ.get("SLURM_CONF"),
        }
        passed = self.home / "slurm-probe.json"
        try:
            earlier = json.loads(passed.read_text())
        except (OSError, ValueError):
            earlier = {}
        if isinstance(earlier, dict) and earlier.get("asked") == asked:
            seen_from = earlier.get("node")
            log.info(
                "Slurm: %d node(s); the run directory was seen from %s (%s)", len(nodes), seen_from, passed
            )
            return
        node = probe_shared(self.runs_dir, dict(self.options))
        try:
            passed.write_text(json.dumps({"asked": asked, "node": node}))
        except OSError as err:  # not remembered: the next start probes again
            log.warning("%s not written: %s", passed, err.strerror)
        log.info("Slurm: %d node(s); a probe job on %s wrote into %s", len(nodes), node, self.runs_dir)

    def _inventory(self) -> list[DeviceInfo]:
        from gpuforge.launch.slurm_partition import partition_nodes

        return cluster_inventory({"per_node": partition_nodes(self.options.get("partition"))})

    def watch(self, stop: threading.Event) -> None:
        watch = lambda: self.seen_holding.run_forever(stop)  # noqa: E731
        threading.Thread(target=watch, name="gpuforge-slurm-holding", daemon=True).start()

    def take_stock(self, running: Sequence[Job]) -> None:
        self.runs = {j.id: runs for j in running if (runs := self._slurm_runs(j))}
        self.seen_holding.keep_only(_logs_folder(j) for j in running)

    def runs_to_charge(self, job_id: int) -> list[Span] | None:
        return self.runs.get(job_id, [])  # none yet: it waits in Slurm's queue, charged nothing

    def holds_devices_since(self, job: RunningRow) -> datetime | None:
        """When its runner first saw its Slurm job run (as of take_stock); None before that."""
        if job.run_started_at is None:
            return None
        runs = self.runs.get(job.id)
        return runs[0][0] if runs else None

    def launch_ranks(self, spec: JobSpec, out: Path) -> dict[str, Any]:
        from gpuforge.launch.job import launch_slurm

        return launch_slurm(spec, out)

    def _slurm_runs(self, job: Job) -> list[Span]:
        """When this job's Slurm jobs ran this attempt: as its runner wrote (_read_slurm_runs), and as this
        server saw (seen_holding), together."""
        # from this attempt's start: an attempt before it, in the same run directory, is not it
        seen = self.seen_holding.spans(_logs_folder(job), since=job.run_started_at)
        return union(_read_slurm_runs(job) or [], seen)


def _read_slurm_runs(job: Job) -> list[Span] | None:
    """When this job's Slurm jobs ran, as its runner saw them (runs.SlurmRuns), on this machine's clock;
    None before the first run, or for a file another runner wrote (not the job's pid)."""
    ran = RunDir(Path(job.run_dir)).slurm_runs()
    if ran is None or ran.runner_pid != job.pid:
        return None
    now = utcnow()
    try:
        return [(min(_utc(a), now), None if b is None else min(_utc(b), now)) for a, b in ran.runs]
    except (OverflowError, ValueError, OSError):  # a time past what datetime holds: not the runner's
        return None


def _logs_folder(job: Job) -> str:
    return str(RunDir(Path(job.run_dir)).logs_dir)


def _utc(unix_time: float) -> datetime:
    return datetime.fromtimestamp(unix_time, UTC)
