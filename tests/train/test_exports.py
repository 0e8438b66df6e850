"""The spec's tracking section: real runs of the tiny digits model into TensorBoard event files and MLflow
stores (SQLite, file), read back with the libraries' own readers; a missing package as one line; a run
that goes on when its MLflow server is down; what a server's policy admits."""

import os
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpuforge.admission import check_spec
from gpuforge.errors import SpecError
from gpuforge.policy import Policy
from gpuforge.runs import RunDir
from gpuforge.runtime.host import free_port
from gpuforge.spec import parse_spec
from gpuforge.train.engine import train
from gpuforge.train.exports import NoTracking, make_tracker
from tests.helpers.cli import run_cli
from tests.helpers.reporters import SignalAt
from tests.helpers.specs import image_spec, write_spec


def _spec(tmp_path, tracking, **train_options):
    return parse_spec({**image_spec(tmp_path, **train_options), "tracking": tracking}, tmp_path)


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _mlflow_run(uri: str, run_dir: Path):
    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "tracking" / "mlflow_run_id").read_text().strip()
    return client, client.get_run(run_id)


@pytest.fixture
def file_store(monkeypatch):
    """MLflow 3 opens a file store only with MLFLOW_ALLOW_FILE_STORE set: the trainer sets it while it opens
    the store a spec names, and puts it back; a test reading the store sets it (`allow()`)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)

    def allow():
        assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # the trainer left the environment as it was
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    return allow


@pytest.mark.slow
def test_tensorboard_holds_every_logged_number_at_its_step(tmp_path):
    summary = train(_spec(tmp_path, {"tensorboard": True}, eval_every=3), tmp_path / "run")
    run = RunDir(tmp_path / "run")
    metrics = run.metrics()
    log_dir = run.root / "tensorboard"
    assert [(s, pytest.approx(v)) for s, v in _scalars(log_dir, "loss")] == [
        (m["step"], m["loss"]) for m in metrics
    ]
    assert [s for s, _ in _scalars(log_dir, "lr")] == list(range(1, 7))
    assert [s for s, _ in _scalars(log_dir, "eval_accuracy")] == [3, 6]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"samples_per_s", "mfu", "step_time_s"} <= tags and "step" not in tags
    assert "tokens_per_s" not in tags  # None for an image model: left out, not written as 0
    # the summary's figures once, at the last step
    assert _scalars(log_dir, "summary/final_loss") == [(6, pytest.approx(summary["final_loss"]))]
    assert _scalars(log_dir, "summary/eval_accuracy")[0][1] == pytest.approx(summary["eval"]["accuracy"])


@pytest.mark.slow
def test_mlflow_sqlite_run_holds_params_metrics_summary_and_model(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # where the trainer runs: MLflow's default artifact root is ./mlruns
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = train(_spec(tmp_path, {"mlflow": {"uri": uri, "experiment": "digits"}}), tmp_path / "run")
    client, run = _mlflow_run(uri, tmp_path / "run")
    assert run.info.run_name == "tiny-digits" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    params = run.data.params
    assert params["train.lr"] == "0.01" and params["model.task"] == "image-classification"
    assert params["train.max_steps"] == "6" and params["tracking.mlflow.uri"] == uri
    losses = client.get_metric_history(run.info.run_id, "loss")
    metrics = RunDir(tmp_path / "run").metrics()
    assert [(m.step, m.value) for m in losses] == [(m["step"], pytest.approx(m["loss"])) for m in metrics]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "samples_per_s")] == list(range(1, 7))
    assert run.data.metrics["final_loss"] == pytest.approx(summary["final_loss"])
    assert run.data.metrics["final_eval_accuracy"] == pytest.approx(summary["eval"]["accuracy"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"summary.json", "model"}
    assert "model/gpuforge.json" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    # beside the database, not in whatever directory the trainer ran in
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_a_resumed_run_goes_on_with_its_mlflow_run_and_event_files(tmp_path, file_store):
    uri = (tmp_path / "mlruns").as_uri()
    spec = _spec(tmp_path, {"tensorboard": True, "mlflow": {"uri": uri}})
    stopped = train(spec, tmp_path / "run", SignalAt(3))
    assert stopped["status"] == "cancelled"
    file_store()
    client, run = _mlflow_run(uri, tmp_path / "run")
    assert run.info.status == "KILLED" and "model" not in {
        a.path for a in client.list_artifacts(run.info.run_id)
    }
    assert train(spec, tmp_path / "run")["resumed_from"] == 3
    client, again = _mlflow_run(uri, tmp_path / "run")
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 7))
    assert "model" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert [s for s, _ in _scalars(tmp_path / "run" / "tensorboard", "loss")] == list(range(1, 7))


def test_a_relative_store_lies_beside_the_spec(tmp_path, file_store):
    for uri, expected in [
        ("sqlite:///db/mlflow.db", f"sqlite:///{tmp_path}/db/mlflow.db"),
        ("file:mlruns", (tmp_path / "mlruns").as_uri()),
        ("mlruns", str(tmp_path / "mlruns")),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ]:
        assert _spec(tmp_path, {"mlflow": {"uri": uri}}).tracking.mlflow.uri == expected
    train(_spec(tmp_path, {"mlflow": {"uri": "mlruns"}}, max_steps=2), tmp_path / "run")
    file_store()
    client, run = _mlflow_run(str(tmp_path / "mlruns"), tmp_path / "run")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_training_goes_on_when_the_mlflow_server_is_down(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, not after minutes
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    summary = train(_spec(tmp_path, {"mlflow": {"uri": uri}}), tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 6
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    assert log.count("tracking.mlflow off for the rest of this run") == 1
    assert not (tmp_path / "run" / "tracking" / "mlflow_run_id").exists()


@pytest.mark.slow
def test_a_missing_package_is_one_line_before_the_run(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", {**image_spec(tmp_path), "tracking": {"tensorboard": True}})
    # tensorboard made unimportable (a real ImportError), then the CLI as a user runs it
    code = (
        "import sys; sys.modules['tensorboard'] = None; sys.argv[0] = 'gpuforge';"
        "from gpuforge.cli import main; main()"
    )
    out = tmp_path / "run"
    done = _python(code, "train", str(spec), "--out", str(out))
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    lines = [line for line in (done.stderr + done.stdout).splitlines() if "tracking.tensorboard" in line]
    assert len(lines) == 1 and "needs the tensorboard package" in lines[0]
    assert "pip install 'gpuforge[tracking]'" in lines[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "spec.yaml").exists()


def _python(code: str, *args: str):
    import subprocess

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_a_missing_mlflow_is_a_spec_error_naming_the_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` fails as where it is not installed
    from gpuforge.spec import TrackingSpec

    with pytest.raises(SpecError, match=r"^tracking\.mlflow: needs the mlflow-skinny .*gpuforge\[tracking\]"):
        make_tracker(TrackingSpec(mlflow={"uri": "sqlite:///x.db"}))
    assert type(make_tracker(TrackingSpec())) is NoTracking


def test_mlflow_from_a_servers_job_is_an_admins_alone(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    member = Policy(user_code=False, roots=(data,))
    admin = Policy(user_code=True, roots=(data,))

    def check(policy, uri):
        raw = {
            "model": {"source": "bundled:gpt-tiny", "task": "causal-lm"},  # no user code of its own
            "data": {"train": "stdlib:docstrings"},
            "tracking": {"mlflow": {"uri": uri}},
        }
        check_spec(policy, parse_spec(raw, tmp_path))

    # MLflow decodes its URI its own way (a percent-encoded ../ in a sqlite:/// path or a plain path is
    # taken apart there, not here): no store of a member's choosing, inside the roots or not
    for uri in [
        f"sqlite:///{data}/mlflow.db",
        f"sqlite:///{data}/%2e%2e/outside.db",
        f"{data}/%2e%2e/outside_store",
        (data / "mlruns").as_uri(),
        "http://127.0.0.1:5000",
    ]:
        with pytest.raises(SpecError, match=r"^tracking\.mlflow\.uri: .* needs an admin key"):
            check(member, uri)
    check(admin, "https://mlflow.example")
    check(admin, f"sqlite:///{tmp_path}/mlflow.db")  # an admin runs code of its choosing anyway
    check(Policy(), f"sqlite:///{tmp_path}/mlflow.db")  # a person at their own shell: anywhere


@pytest.mark.slow
def test_a_runner_checks_the_store_against_its_own_policy(tmp_path):
    """A runner the server started for a member's job (its policy in its environment) refuses MLflow,
    whatever its spec file says, before anything is written."""
    data = tmp_path / "data"
    data.mkdir()
    raw = {
        "model": {"source": "bundled:gpt-tiny", "task": "causal-lm"},
        "data": {"train": "stdlib:docstrings"},
        "train": {"max_steps": 1},
        "tracking": {"mlflow": {"uri": f"sqlite:///{data}/mlflow.db"}},
    }
    spec = write_spec(data / "spec.yaml", raw)
    env = {"GPUFORGE_CONFINE_ROOTS": str(data), "GPUFORGE_USER_CODE": "0"}
    done = run_cli("train", str(spec), "--out", str(data / "run"), env=env)
    assert done.returncode == 2, done.stderr
    assert "tracking.mlflow.uri: " in done.stderr and "needs an admin key" in done.stderr
    assert not (data / "mlflow.db").exists() and not (data / "run" / "metrics.jsonl").exists()


def test_a_spec_names_a_wrong_tracking_key(tmp_path):
    with pytest.raises(SpecError, match=r"tracking\.mlflow\.uri: Field required"):
        _spec(tmp_path, {"mlflow": {"experiment": "x"}})
    with pytest.raises(
        SpecError, match=r"tracking\.tensorbord: unknown key \(did you mean tracking\.tensorboard"
    ):
        _spec(tmp_path, {"tensorbord": True})
