"""The spec's `tracking:` section: the metrics of a run sent beside metrics.jsonl, to TensorBoard event files
(<run>/tensorboard/) and to an MLflow run, by the main process only.

Both need packages that are no dependency of gpuforge (`pip install 'gpuforge[tracking]'`); they are
imported when a spec asks for them, and a missing one is a one-line error before the run starts. After
that, tracking never stops training: the first failure (the MLflow server down, a full disk) is one
warning in the log, and that destination is off for the rest of the process. MLflow's requests run on a
thread of their own, so a slow server does not slow the steps; the run's end waits for them.

One MLflow run a gpuforge run: its id is kept in <run>/tracking/mlflow_run_id, and a resumed run (after a
signal, a budget pause or a restart) goes on with it.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuforge.errors import SpecError
from gpuforge.policy import current as current_policy
from gpuforge.runs import RunDir
from gpuforge.spec import JobSpec, MlflowSpec, TrackingSpec, mlflow_local_path

log = logging.getLogger("gpuforge.train")

INSTALL = "pip install 'gpuforge[tracking]'"
MAX_PARAM_CHARS = 6000  # MLflow refuses longer parameter values
CLOSE_WAIT_S = 600.0  # the run's end waits this long at most for MLflow's requests (the model's upload)
# how a run ended, in MLflow's words; paused and cancelled runs go on (RUNNING again) when resumed
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "paused": "KILLED"}


class Tracker:
    """What the training loop tells a tracker, each a no-op here (NoTracking)."""

    def open(self, run: RunDir, spec: JobSpec, resumed: int | None) -> None:
        """Start (or, `resumed` from that checkpoint step, go on with) the run's tracking."""

    def metric(self, record: dict[str, Any] | None) -> None:
        """A metrics.jsonl record (None: no record at this step)."""

    def finish(self, summary: dict[str, Any], model_dir: Path) -> None:
        """The run's summary and, when written, its model."""

    def close(self, error: BaseException | None = None) -> None:
        """Release what `open` took; `error`: what stopped the run before `finish`."""

    @contextmanager
    def opened(self, run: RunDir, spec: JobSpec, resumed: int | None) -> Iterator[Tracker]:
        self.open(run, spec, resumed)
        try:
            yield self
        except BaseException as err:
            self.close(err)
            raise
        self.close()


class NoTracking(Tracker):
    """A spec without `tracking:`, or a process other than the main one: nothing to do."""


def make_tracker(tracking: TrackingSpec) -> Tracker:
    """The tracker a spec asks for; its packages are imported now, so that a missing one stops the run
    before it starts."""
    trackers: list[Tracker] = []
    if tracking.tensorboard:
        trackers.append(TensorBoard())
    if tracking.mlflow is not None:
        trackers.append(Mlflow(tracking.mlflow))
    if not trackers:
        return NoTracking()
    return trackers[0] if len(trackers) == 1 else Trackers(trackers)


class Trackers(Tracker):
    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def open(self, run: RunDir, spec: JobSpec, resumed: int | None) -> None:
        for t in self.trackers:
            t.open(run, spec, resumed)

    def metric(self, record: dict[str, Any] | None) -> None:
        for t in self.trackers:
            t.metric(record)

    def finish(self, summary: dict[str, Any], model_dir: Path) -> None:
        for t in self.trackers:
            t.finish(summary, model_dir)

    def close(self, error: BaseException | None = None) -> None:
        for t in self.trackers:
            t.close(error)


def _require(field: str, package: str, *modules: str) -> None:
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError as err:
        raise SpecError(f"{field}: needs the {package} package ({err}): {INSTALL}") from None


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a record by name (nested dicts as name_key; the step, None and flags left out)."""
    found: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            found.update(scalars(value, f"{prefix}{key}_"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            found[f"{prefix}{key}"] = float(value)
    return found


def flat_params(spec: JobSpec) -> dict[str, str]:
    """The resolved spec as MLflow parameters: `train.lr` -> "0.01"; lists and empty sections as JSON."""
    params: dict[str, str] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(inner, f"{name}.{key}" if name else str(key))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = text[:MAX_PARAM_CHARS]

    walk(spec.model_dump(mode="json"), "")
    return params


class _Once:
    """A destination that turns itself off at its first failure, with one warning."""

    name = "tracking"

    def __init__(self) -> None:
        self.broken = False

    def attempt(self, what: str, action: Callable[[], Any]) -> None:
        if self.broken:
            return
        try:
            action()
        except Exception as err:  # whatever the library raises: training goes on without it
            self.broken = True
            detail = " ".join(f"{type(err).__name__}: {err}".split())
            detail = detail if len(detail) <= 400 else detail[:397] + "..."
            log.warning(
                "%s off for the rest of this run (%s failed; training goes on): %s", self.name, what, detail
            )


class TensorBoard(Tracker, _Once):
    """Event files in <run>/tensorboard/: a scalar for each number of each metrics record, at its step;
    the summary's numbers as summary/<name> at the last step."""

    name = "tracking.tensorboard"

    def __init__(self) -> None:
        _Once.__init__(self)
        _require(self.name, "tensorboard", "tensorboard", "torch.utils.tensorboard")
        self.writer = None

    def open(self, run: RunDir, spec: JobSpec, resumed: int | None) -> None:
        def start() -> None:
            from torch.utils.tensorboard import SummaryWriter

            # steps past the checkpoint ran in a process that stopped: they run again, so their events go
            self.writer = SummaryWriter(
                str(run.root / "tensorboard"), purge_step=None if resumed is None else resumed + 1
            )

        self.attempt("opening the event file", start)

    def metric(self, record: dict[str, Any] | None) -> None:
        if record is not None and self.writer is not None:
            self.attempt("writing a step", lambda: self._scalars(scalars(record), "", record["step"]))

    def finish(self, summary: dict[str, Any], model_dir: Path) -> None:
        if self.writer is not None:
            self.attempt(
                "writing the summary", lambda: self._scalars(scalars(summary), "summary/", summary["steps"])
            )

    def _scalars(self, values: dict[str, float], prefix: str, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(prefix + key, value, step)

    def close(self, error: BaseException | None = None) -> None:
        if self.writer is not None:
            self.attempt("closing the event file", self.writer.close)
            self.writer = None


class Mlflow(Tracker, _Once):
    """An MLflow run named after the job: the resolved spec as parameters, each metrics record's numbers
    at its step, the summary's numbers as final_<name>, summary.json and model/ as artifacts. Every
    request runs on one thread, in order; the run's end waits for them (CLOSE_WAIT_S at most)."""

    name = "tracking.mlflow"

    def __init__(self, settings: MlflowSpec) -> None:
        _Once.__init__(self)
        _require(self.name, "mlflow-skinny (or mlflow)", "mlflow")
        self.settings = settings
        self.client = None
        self.run: RunDir | None = None
        self.run_id: str | None = None
        self._tasks: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # --- the training loop's side: each call queues the work and returns ---

    def open(self, run: RunDir, spec: JobSpec, resumed: int | None) -> None:
        self.run = run
        self._tasks.put(("starting the run", lambda: self._start(run, spec)))
        self._thread = threading.Thread(target=self._work, name="gpuforge-mlflow", daemon=True)
        self._thread.start()

    def metric(self, record: dict[str, Any] | None) -> None:
        if record is not None and not self.broken:
            values, step, ms = scalars(record), record["step"], int(time.time() * 1000)
            self._tasks.put(("logging a step", lambda: self._log(values, step, ms)))

    def finish(self, summary: dict[str, Any], model_dir: Path) -> None:
        if not self.broken:
            self._tasks.put(("logging the summary and model", lambda: self._finish(summary, model_dir)))

    def close(self, error: BaseException | None = None) -> None:
        if self._thread is None:
            return
        if error is not None and not self.broken:
            status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            self._tasks.put(("ending the run", lambda: self._end(status)))
        self._tasks.put(None)
        wait = 5.0 if isinstance(error, KeyboardInterrupt) else CLOSE_WAIT_S  # a second Ctrl-C: not for long
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("%s: still sending after %.0f s; left unfinished", self.name, wait)
        self._thread = None

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            self.attempt(*task)

    # --- the thread's side ---

    def _start(self, run: RunDir, spec: JobSpec) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = self.settings.uri
        with _file_store_allowed(uri):
            self.client = client = MlflowClient(tracking_uri=uri)
        id_path = run.root / "tracking" / "mlflow_run_id"
        if id_path.exists():  # a resumed run: go on with its MLflow run
            run_id = id_path.read_text().strip()
            try:
                client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.info("%s: run %s is not in %s; starting another", self.name, run_id, uri)
        if self.run_id is None:
            created = client.create_run(
                self._experiment_id(), run_name=spec.name, tags={"gpuforge.run_dir": str(run.root)}
            )
            self.run_id = created.info.run_id
            id_path.parent.mkdir(parents=True, exist_ok=True)
            id_path.write_text(self.run_id + "\n")
            self._check_artifacts(created.info.artifact_uri)
            params = [Param(k, v) for k, v in flat_params(spec).items()]
            client.log_batch(self.run_id, params=params)
        else:
            self._check_artifacts(client.get_run(self.run_id).info.artifact_uri)
        log.info("%s: run %s in %s (experiment %s)", self.name, self.run_id, uri, self.settings.experiment)

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name, uri = self.settings.experiment, self.settings.uri
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if uri.startswith("sqlite:///"):  # MLflow's default is ./mlruns, wherever the trainer runs
            location = (Path(mlflow_local_path(uri)).parent / "mlartifacts").as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException as err:  # another run made it meanwhile
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _check_artifacts(self, artifact_uri: str) -> None:
        """A server's job writes its artifacts inside the data roots too: an experiment made beforehand
        (a store the job brought along) may put them anywhere."""
        policy = current_policy()
        if policy.roots is None or policy.user_code:
            return  # a person's own run, or an admin's job: MLflow is theirs (admission.py)
        local = mlflow_local_path(artifact_uri)
        if local is not None:
            policy.check_path("tracking.mlflow.uri: the experiment's artifact location", local)
        elif not policy.user_code:
            raise SpecError(f"{self.name}: artifacts at {artifact_uri} need an admin key")

    def _log(self, values: dict[str, float], step: int, ms: int) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ms, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def _finish(self, summary: dict[str, Any], model_dir: Path) -> None:
        from mlflow.entities import Metric

        ms, step = int(time.time() * 1000), summary.get("steps") or 0
        final = [
            Metric(key if key.startswith("final_") else f"final_{key}", value, ms, step)
            for key, value in scalars(summary).items()
        ]
        self.client.log_batch(self.run_id, metrics=final)
        if self.run.summary_path.exists():
            self.client.log_artifact(self.run_id, str(self.run.summary_path))
        if model_dir.is_dir():
            self.client.log_artifacts(self.run_id, str(model_dir), "model")
        self._end(MLFLOW_STATUS.get(summary.get("status"), "FINISHED"))

    def _end(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status)


@contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses file stores unless MLFLOW_ALLOW_FILE_STORE is set; a spec that names one asks for
    it. Set while the store is made (MLflow keeps it), a value the user set left alone."""
    local = mlflow_local_path(uri) is not None and not uri.startswith("sqlite:")
    if not local or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
