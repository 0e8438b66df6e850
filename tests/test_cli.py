"""The CLI as a user meets it: real subprocesses, one-line errors, nothing written over."""

import json
import re

import pytest
import yaml

from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec, write_spec


def _one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuforge: error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
def test_train_with_overrides_fills_out_and_says_where(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=50))
    result = run_cli(
        "train",
        str(spec),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "3",
        "--set",
        "train.lr=1e-3",
        "--set",
        "cost.usd_per_hour=2",
    )
    assert result.returncode == 0, result.stderr
    assert f"run directory: {tmp_path / 'run'}" in result.stdout and "finished at step 3/3" in result.stdout
    stored = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    assert stored["train"]["lr"] == 1e-3 and stored["train"]["max_steps"] == 3
    assert stored["cost"]["usd_per_hour"] == 2
    assert "precision fp32" in result.stderr or "precision bf16" in result.stderr  # auto says what it picked
    assert "step     3/3" in result.stderr  # the progress bar's last state


def _bad_inputs(tmp_path):
    good = image_spec(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nolabel.jsonl").write_text(json.dumps({"text": "hello", "topic": "x"}) + "\n")
    (tmp_path / "a-file").write_text("precious")
    text_job = {"model": {"source": "bundled:minilm", "task": "sequence-classification"}}
    return {
        "malformed": ("name: a\n  model: b\n", [], ["malformed YAML", "line 2"]),
        "unknown key": (yaml.safe_dump({**good, "trian": {}}), [], ["trian: unknown key"]),
        "wrong type": (yaml.safe_dump({**good, "train": {"max_steps": "many"}}), [], ["train.max_steps"]),
        "missing data": (
            yaml.safe_dump({**text_job, "data": {"train": "absent.jsonl"}}),
            [],
            ["data.train", "absent.jsonl: no such file"],
        ),
        "empty data": (
            yaml.safe_dump({**text_job, "data": {"train": "empty.jsonl"}}),
            [],
            ["holds no records"],
        ),
        "no label column": (
            yaml.safe_dump({**text_job, "data": {"train": "nolabel.jsonl"}}),
            [],
            ["data.label_field: 'label' not found"],
        ),
        "model dir": (
            yaml.safe_dump({**good, "model": {"source": "hf:nowhere", "task": "causal-lm"}}),
            [],
            ["model.source", "nowhere: no such directory"],
        ),
        "out is a file": (yaml.safe_dump(good), ["--out", str(tmp_path / "a-file")], ["is a file"]),
        "out under a file": (
            yaml.safe_dump(good),
            ["--out", str(tmp_path / "a-file" / "run")],
            ["is a file"],
        ),
        "bad --set": (
            yaml.safe_dump(good),
            ["--set", "train.lr"],
            ["--set train.lr: expected key.path=value"],
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "malformed",
        "unknown key",
        "wrong type",
        "missing data",
        "empty data",
        "no label column",
        "model dir",
        "out is a file",
        "bad --set",
        "out under a file",
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    text, extra, fragments = _bad_inputs(tmp_path)[case]
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args = ["train", str(spec), *extra]
    if "--out" not in extra:
        args += ["--out", str(tmp_path / "out")]
    _one_line_error(run_cli(*args, cwd=tmp_path), *fragments)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing written over
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_missing_spec_file(tmp_path):
    _one_line_error(run_cli("train", str(tmp_path / "nope.yaml")), "no such spec file")


@pytest.mark.slow
def test_nan_loss_exits_1_with_one_line(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=8, options={"nan_after": 2}))
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert result.returncode == 1 and "gpuforge: training failed: loss is nan at step 3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_spent_budget_exits_3_and_says_how_to_go_on(tmp_path):
    raw = {**image_spec(tmp_path, max_steps=50), "cost": {"usd_per_hour": 1e6, "budget_usd": 0.5}}
    result = run_cli("train", str(write_spec(tmp_path / "s.yaml", raw)), "--out", str(tmp_path / "run"))
    assert result.returncode == 3, result.stderr
    assert "paused: cost.budget_usd 0.5 spent" in result.stdout and "raise cost.budget_usd" in result.stdout


def _demo_examples(tmp_path):
    examples = tmp_path / "examples"
    examples.mkdir()
    write_spec(examples / "a.yaml", image_spec(tmp_path))
    compress = {"quantize": "int8"}
    write_spec(examples / "b.yaml", {**image_spec(tmp_path), "name": "other", "compress": compress})
    return examples


@pytest.mark.slow
def test_demo_runs_every_example_through_a_server_and_tabulates_them(tmp_path):
    examples = _demo_examples(tmp_path)
    result = run_cli("demo", "--examples", str(examples), "--out", str(tmp_path / "out"), "--max-steps", "2")
    assert result.returncode == 0, result.stderr
    runs = [tmp_path / "out" / "server" / "runs" / f"job-{i}" for i in (1, 2)]
    for run in runs:
        assert json.loads((run / "summary.json").read_text())["steps"] == 2
        assert str(run) in result.stdout
    assert "gpuforge demo (through the server)" in result.stdout and result.stdout.count(" finished ") >= 2
    assert not (runs[0] / "compressed").exists() and (runs[1] / "compressed" / "report.json").exists()


@pytest.mark.slow
def test_demo_local_trains_every_spec_in_the_folder_and_says_where(tmp_path):
    examples = _demo_examples(tmp_path)
    scripts = examples / "scripts"  # a team's own loop, run as a script job beside the specs
    scripts.mkdir()
    (scripts / "count.py").write_text(
        "from gpuforge import track\nfor step in range(3):\n    track.log(step, loss=1.0 / (step + 1))\n"
    )
    script = {"command": "python count.py", "files": ["count.py"]}
    write_spec(scripts / "c.yaml", {"name": "counting", "kind": "script", "script": script})
    out = tmp_path / "out"
    result = run_cli("demo", "--local", "--examples", str(examples), "--out", str(out), "--max-steps", "2")
    assert result.returncode == 0, result.stderr
    runs = sorted((tmp_path / "out").iterdir())
    assert [p.name.split("-")[0] for p in runs] == ["a", "b", "c"]
    for run, steps in zip(runs, (2, 2, 3), strict=True):  # --max-steps is the specs', not the script's
        assert json.loads((run / "summary.json").read_text())["steps"] == steps
        assert str(run.resolve()) in result.stdout
    assert "counting" in result.stdout and "0.3333" in result.stdout  # the script's row: its last loss
    assert not (runs[0] / "compressed").exists() and (runs[1] / "compressed" / "report.json").exists()
    _one_line_error(run_cli("demo", "--examples", str(tmp_path / "none")), "no *.yaml example specs")


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "train.lerning_rate=1e-3",
            "gpuforge: error: --set train.lerning_rate=1e-3: unknown key (did you mean train.lr?)",
        ),
        ("train.lr=abc", "gpuforge: error: --set train.lr=abc: must be a number or 'auto', got 'abc'"),
        (
            "train.batch_size=x",
            "gpuforge: error: --set train.batch_size=x: must be an integer or 'auto', got 'x'",
        ),
        ("trian.lr=1", "gpuforge: error: --set trian.lr=1: unknown key (did you mean train?)"),
    ],
)
@pytest.mark.slow
def test_a_bad_set_is_blamed_on_the_set_once_with_a_suggestion(tmp_path, override, line):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path))
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"), "--set", override)
    _one_line_error(result)
    assert result.stderr.strip() == line


@pytest.mark.slow
def test_a_typo_in_the_file_is_blamed_on_the_file_with_a_suggestion(tmp_path):
    raw = image_spec(tmp_path)
    raw["train"]["num_epochs"] = raw["train"].pop("max_steps")
    spec = write_spec(tmp_path / "job.yaml", raw)
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"), "--set", "train.seed=-1")
    _one_line_error(result)
    assert result.stderr.strip() == (
        f"gpuforge: error: {spec}: train.num_epochs: unknown key (did you mean train.epochs?); "
        "--set train.seed=-1: must be >= 0"
    )


@pytest.mark.slow
def test_the_progress_bar_shows_the_latest_eval(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=4, eval_every=2))
    result = run_cli("train", str(spec), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    bar = [line for line in result.stderr.splitlines() if line.startswith("step     4/4")]
    assert len(bar) == 1 and re.search(r" loss \d\.\d{4} eval acc \d\.\d{3} ", bar[0]), result.stderr


def test_the_compress_flags_are_the_compress_options_with_their_defaults_and_help():
    """`gpuforge compress` writes its flags out (no pydantic at start-up): they must stay CompressOptions'."""
    import typer

    from gpuforge.cli import app
    from gpuforge.compress.options import CompressOptions, flag

    params = {p.name: p for p in typer.main.get_command(app).commands["compress"].params}
    for name, field in CompressOptions.model_fields.items():
        param = params[name]
        assert param.opts == [flag(name)], name
        assert (param.default, param.help) == (field.default, field.description), name
        assert _plain(field.annotation) == param.type_descriptor.annotation, name


def _plain(annotation):
    """The type a flag parses to: Literal["a", "b"] as str, X | None as X."""
    import types
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _plain(args[0]) if len(args) == 1 else annotation
    return annotation
