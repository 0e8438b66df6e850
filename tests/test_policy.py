"""The policy a server's job holds to: user code, and files inside the roots after every symlink."""

import pytest

from gpuforge.errors import SpecError
from gpuforge.models import checked_options
from gpuforge.policy import Policy


def test_from_env_round_trips_and_a_person_at_a_shell_is_unconfined(tmp_path, monkeypatch):
    policy = Policy(user_code=False, roots=(tmp_path / "a", tmp_path / "b"))
    for name, value in policy.environment().items():
        monkeypatch.setenv(name, value)
    assert Policy.from_env() == policy
    monkeypatch.delenv("GPUFORGE_USER_CODE")
    monkeypatch.delenv("GPUFORGE_CONFINE_ROOTS")
    assert Policy.from_env() == Policy(user_code=True, roots=None)


def test_paths_are_checked_where_they_lead(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "model").mkdir(parents=True)
    outside.mkdir()
    (outside / "weights").write_text("w")
    (root / "model" / "config.json").write_text("{}")
    policy = Policy(roots=(root,))
    policy.check_path("model.source", root / "model")
    (root / "model" / "weights").symlink_to(outside / "weights")
    with pytest.raises(SpecError, match=r"model.source: .*/root/model \(through .*/weights\) is outside"):
        policy.check_path("model.source", root / "model")
    with pytest.raises(SpecError, match="data.train: .* is outside the server's data roots"):
        policy.check_path("data.train", root / ".." / "outside" / "weights")
    Policy().check_path("data.train", outside / "weights")  # no roots: a person's own files


def test_model_options_are_an_allow_list_with_types():
    assert checked_options("bundled:gpt-tiny", {"n_layer": 2, "attn_pdrop": 0.1}, False) == {
        "n_layer": 2,
        "attn_pdrop": 0.1,
    }
    assert checked_options("hf:/m", {"trust_remote_code": True}, True) == {"trust_remote_code": True}
    cases = [
        ("hf:/m", {"trust_remote_code": True}, "model.options.trust_remote_code: runs the model directory"),
        ("hf:/m", {"_configuration_file": "/x"}, "model.options._configuration_file: unknown for hf:/m"),
        ("bundled:minilm", {"subfolder": ".."}, "model.options.subfolder: unknown for bundled:minilm"),
        ("bundled:gpt-tiny", {"n_layer": "many"}, "model.options.n_layer: must be a valid integer"),
        ("bundled:minilm", {"hidden_dropout_prob": 2}, "model.options.hidden_dropout_prob: must be less"),
        ("torchvision:resnet18", {"norm_layer": "x"}, "model.options.norm_layer: unknown"),
        ("python:m.py:build", {}, "python: models run their own code"),
    ]
    for source, options, message in cases:
        with pytest.raises(SpecError, match=message.replace("(", r"\(")):
            checked_options(source, options, False)
    assert checked_options("python:m.py:build", {"anything": [1]}, True) == {"anything": [1]}


def test_a_root_above_the_servers_home_does_not_open_its_runs(tmp_path):
    home = tmp_path / "home"
    (home / "runs" / "job-1" / "model").mkdir(parents=True)
    (home / "uploads").mkdir()
    (home / "uploads" / "abc.jsonl").write_text("{}\n")
    policy = Policy(user_code=False, roots=(tmp_path, home / "uploads"), excluded=(home,))
    policy.check_path("data.train", home / "uploads" / "abc.jsonl")  # a root inside the home: readable
    with pytest.raises(SpecError, match="model.source: .*/runs/job-1/model is outside"):
        policy.check_path("model.source", home / "runs" / "job-1" / "model")


def test_linked_directories_are_walked_and_loops_are_an_error_not_a_crash(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "model").mkdir(parents=True)
    (root / "shared").mkdir()
    outside.mkdir()
    (outside / "secret").write_text("s")
    (root / "shared" / "leak").symlink_to(outside / "secret")
    (root / "model" / "sub").symlink_to(root / "shared")  # inside the roots itself, and a file in it is not
    policy = Policy(roots=(root,))
    with pytest.raises(SpecError, match=r"\(through .*/model/sub/leak\) is outside"):
        policy.check_path("model.source", root / "model")
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(SpecError, match="data.train: .*/loop cannot be resolved"):
        policy.check_path("data.train", root / "loop")


def test_a_confined_process_still_loads_what_gpuforge_ships(tmp_path, monkeypatch):
    from gpuforge.models import load_tokenizer

    for name, value in Policy(user_code=False, roots=(tmp_path,)).environment().items():
        monkeypatch.setenv(name, value)
    assert load_tokenizer("bundled:minilm", "sequence-classification", None) is not None
    with pytest.raises(SpecError, match="data.tokenizer: /usr is outside"):
        load_tokenizer("bundled:minilm", "sequence-classification", "hf:/usr")


def test_a_serving_worker_holds_to_its_policy_whatever_the_manifest_says(
    tmp_path, monkeypatch, tiny_bert_dir
):
    """A model directory's gpuforge.json is a file: one edited to ask for the directory's own code, or to
    name weights elsewhere, is refused where the worker loads it."""
    import json
    import shutil

    from gpuforge.artifact import load_artifact
    from gpuforge.errors import ModelError

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model_dir)
    manifest = {"format": "transformers", "kind": "full", "task": "sequence-classification",
                "source": f"hf:{tiny_bert_dir}", "options": {}, "tokenizer": "saved"}  # fmt: skip
    (model_dir / "gpuforge.json").write_text(json.dumps(manifest))
    assert load_artifact(model_dir)[2]["task"] == "sequence-classification"  # as trained: loads
    for name, value in Policy(user_code=False, roots=(tmp_path,)).environment().items():
        monkeypatch.setenv(name, value)
    (model_dir / "gpuforge.json").write_text(json.dumps({**manifest, "options": {"trust_remote_code": True}}))
    with pytest.raises(SpecError, match="model.options.trust_remote_code: runs the model directory"):
        load_artifact(model_dir)
    quantized = {**manifest, "compression": {"quantize": {"kind": "int8", "skip": []}}, "weights": "../x.pt"}
    (model_dir / "gpuforge.json").write_text(json.dumps(quantized))
    with pytest.raises(ModelError, match="names weights outside the directory"):
        load_artifact(model_dir)
