"""What the server asks of a running worker: the eval metric measured at load (--eval-at-load, /info's
eval), and LoRA adapters added and removed while it serves (--adapters-root, /admin/adapters)."""

import json
import logging
import shutil

import pytest
import torch

from gpuforge.artifact import built_from, load_artifact
from gpuforge.artifact.origin import open_source
from gpuforge.runtime import tasks
from tests.serve.test_worker import _client, _offline
from tests.serve.tiny_runs import train_digits, train_topics

KEY = "gf_admin-key-0123456789abcdef"
TEXTS = ["the striker scored twice", "shares fell sharply", "a new phone was launched"]


@pytest.fixture(scope="module")
def root(three_adapters):
    """The folder the three adapter runs lie in: the workers' --adapters-root."""
    return three_adapters[0].parent.parent


@pytest.fixture(scope="module")
def full_model(root, tiny_bert_dir):
    """A full (not LoRA) topics classifier on the same tiny BERT, under the root."""
    (root / "full").mkdir()
    return train_topics(root / "full", tiny_bert_dir)


def _variant(model_dir, to, **manifest):
    """A copy of adapter `model_dir` at `to` whose gpuforge.json says `manifest` instead."""
    shutil.copytree(model_dir, to)
    written = json.loads((to / "gpuforge.json").read_text())
    (to / "gpuforge.json").write_text(json.dumps({**written, **manifest}))
    return to


def _held_out_accuracy(model_dir):
    """The accuracy of `model_dir` on its run's held-out split, counted here row by row."""
    module, _, manifest = load_artifact(model_dir)
    held_out = open_source(model_dir).data.eval
    batch = held_out.collate(list(range(len(held_out))))
    with torch.no_grad():
        logits = tasks.forward(built_from(module.eval(), manifest), manifest.task, batch)
    return float((logits.argmax(-1) == batch["labels"]).float().mean()), len(held_out)


def _predict(client, adapter=None, headers=None):
    body = {"inputs": TEXTS, **({"adapter": adapter} if adapter else {})}
    return client.post("/predict", json=body, headers=headers)


def test_eval_at_load_gives_the_held_out_accuracy_as_served(three_adapters, tmp_path, caplog):
    own = three_adapters[0]
    accuracy, examples = _held_out_accuracy(own)
    assert examples == 24
    measured = {"metric": "accuracy", "value": pytest.approx(accuracy), "examples": examples}
    for options, expected in (({"eval_at_load": True}, measured), ({}, None)):
        client = _client(own, **options)
        try:
            assert client.get("/info").json()["eval"] == expected  # /readyz was 200: measured by then
        finally:
            client.__exit__(None, None, None)

    alone = shutil.copytree(own, tmp_path / "model")  # no run's spec.yaml beside it: no held-out split
    with caplog.at_level(logging.WARNING, logger="gpuforge.serve"):
        client = _client(alone, eval_at_load=True)
    try:
        assert client.get("/info").json()["eval"] is None
        assert "--eval-at-load: no held-out split" in caplog.text and "spec.yaml" in caplog.text
    finally:
        client.__exit__(None, None, None)


def test_eval_at_load_measures_the_model_as_quantized(tmp_path):
    model_dir = train_digits(tmp_path, 10)
    client = _client(model_dir, eval_at_load=True, quantize="int8-dynamic", device="cpu")
    try:
        info = client.get("/info").json()
        report = info["quantize_report"]
        assert report["after"] != report["before"]  # on a CPU, int8-dynamic moves the CNN's accuracy
        as_served = {"metric": "accuracy", "value": report["after"], "examples": report["examples"]}
        assert info["eval"] == as_served
    finally:
        client.__exit__(None, None, None)


def test_adapters_come_and_go_while_the_worker_serves(three_adapters, root):
    own, b, c = three_adapters
    upper = _variant(b, root / "upper" / "model", labels=["COOKING", "SPORTS", "TECHNOLOGY", "WEATHER"])
    client = _client(own, adapters_root=str(root), max_adapters=3)
    try:
        before = _predict(client).json()["outputs"]
        added = client.post("/admin/adapters", json={"name": "b.v1", "path": str(b)})
        assert (added.status_code, added.json()) == (201, {"adapters": ["default", "b.v1"]})
        relative = client.post("/admin/adapters", json={"name": "c", "path": "c/model"})  # from the root
        assert relative.status_code == 201
        assert client.get("/info").json()["adapters"] == ["default", "b.v1", "c"]
        for name, path in (("b.v1", b), ("c", c)):  # each answers as it would alone, at once
            outputs = _predict(client, name).json()["outputs"]
            expected = _offline(path, TEXTS)[1]
            assert [o["score"] for o in outputs] == pytest.approx(expected.max(-1).values.tolist(), abs=1e-4)
        assert _predict(client).json()["outputs"] == before  # the served model's own is as it was
        adapters = client.app.state.backend.predictor.adapters
        assert "gf-b~v1" in adapters.model.peft_config  # PEFT's name for it: no "." in a ModuleDict's

        again = client.post("/admin/adapters", json={"name": "b.v1", "path": str(b)})
        assert (again.status_code, again.json()["adapters"]) == (200, ["default", "b.v1", "c"])
        for name, path in (("b.v1", c), ("default", b)):
            taken = client.post("/admin/adapters", json={"name": name, "path": str(path)})
            assert taken.status_code == 409 and repr(name) in taken.json()["detail"]

        gone = client.delete("/admin/adapters/b.v1")
        assert (gone.status_code, gone.json()) == (200, {"adapters": ["default", "c"]})
        refused, unknown = _predict(client, "b.v1"), _predict(client, "nope")
        assert refused.status_code == unknown.status_code == 404
        assert refused.json()["detail"] == unknown.json()["detail"].replace("'nope'", "'b.v1'")
        assert client.delete("/admin/adapters/b.v1").status_code == 404
        own_one = client.delete("/admin/adapters/default")
        assert own_one.status_code == 409 and "served model's own" in own_one.json()["detail"]
        assert _predict(client, "c").status_code == 200  # the batch frees b.v1's weights first
        assert "b.v1" not in adapters.loaded and "gf-b~v1" not in adapters.model.peft_config

        # the name again, for b's weights under other labels: its manifest's
        assert client.post("/admin/adapters", json={"name": "b.v1", "path": str(upper)}).status_code == 201
        labels = [o["label"] for o in _predict(client, "b.v1").json()["outputs"]]
        assert labels == [label.upper() for label in _offline(b, TEXTS)[0]]
    finally:
        client.__exit__(None, None, None)


def test_an_input_whose_adapter_went_while_it_waited_is_refused_alone(three_adapters, root):
    own, b, _ = three_adapters
    client = _client(own, adapters_root=str(root))
    try:
        assert client.post("/admin/adapters", json={"name": "b", "path": str(b)}).status_code == 201
        predictor = client.app.state.backend.predictor
        checked = predictor.check("the striker scored twice")
        predictor.adapters.remove("b")  # after its request was taken, before its batch runs
        refused, answered = predictor.run_batch([("b", checked), (None, checked)])
        assert refused.status == 404 and "unknown adapter 'b'" in str(refused)
        assert answered["label"] == _predict(client).json()["outputs"][0]["label"]
    finally:
        client.__exit__(None, None, None)


@pytest.mark.slow
def test_what_an_adapter_must_be_to_be_added(three_adapters, root, full_model, tmp_path):
    own, b, _ = three_adapters
    outside = shutil.copytree(b, tmp_path / "outside")
    (root / "link").symlink_to(outside, target_is_directory=True)
    other_base = _variant(b, root / "other-base" / "model", base="hf:/elsewhere/bert")
    client = _client(own, adapters_root=str(root))
    try:
        for path in (
            str(outside),
            f"../{tmp_path.name}/outside",
            "link",
        ):  # links followed: where it really is
            refused = client.post("/admin/adapters", json={"name": "x", "path": path})
            assert refused.status_code == 403 and path in refused.json()["detail"], path
        for path, words in ((full_model, "a full model, not a LoRA adapter"), (other_base, "its base is"),
                            (root / "missing", "gpuforge.json")):  # fmt: skip
            refused = client.post("/admin/adapters", json={"name": "x", "path": str(path)})
            assert refused.status_code == 422 and words in refused.json()["detail"], path
        for body in ({"name": "-x", "path": str(b)}, {"name": "x" * 101, "path": str(b)},
                     {"name": "x", "path": str(b), "extra": 1}, {"name": "x"}):  # fmt: skip
            assert client.post("/admin/adapters", json=body).status_code == 422, body
        assert client.get("/info").json()["adapters"] == ["default"]
    finally:
        client.__exit__(None, None, None)

    client = _client(full_model, adapters_root=str(root))  # nothing to put adapters on
    try:
        refused = client.post("/admin/adapters", json={"name": "b", "path": str(b)})
        assert refused.status_code == 409 and "full model" in refused.json()["detail"]
    finally:
        client.__exit__(None, None, None)


def test_adapter_admin_is_off_without_a_root_and_needs_the_key(three_adapters, root):
    own, b, _ = three_adapters
    client = _client(own)
    try:
        for response in (client.post("/admin/adapters", json={"name": "b", "path": str(b)}),
                         client.delete("/admin/adapters/b")):  # fmt: skip
            assert response.status_code == 404
            assert response.json()["detail"] == "adapter admin is off (--adapters-root)"
    finally:
        client.__exit__(None, None, None)

    client = _client(own, api_key=KEY, adapters_root=str(root))
    key = {"Authorization": f"Bearer {KEY}"}
    try:
        body = {"name": "b", "path": str(b)}
        assert client.post("/admin/adapters", json=body).status_code == 401
        assert client.delete("/admin/adapters/b").status_code == 401
        assert client.post("/admin/adapters", json=body, headers=key).status_code == 201
        assert client.delete("/admin/adapters/b", headers={"X-API-Key": "wrong"}).status_code == 401
        assert client.delete("/admin/adapters/b", headers=key).status_code == 200
    finally:
        client.__exit__(None, None, None)
