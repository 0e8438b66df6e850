"""The endpoint worker on real trained models (a tiny BERT classifier, the digits CNN), in process."""

import json
import time

import pytest
import torch
from fastapi.testclient import TestClient

from gpuforge.artifact import built_from, load_artifact
from gpuforge.runtime import tasks
from gpuforge.serve.options import ServeOptions
from gpuforge.serve.worker import create_worker
from tests.serve.tiny_runs import train_digits, train_topics


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, tiny_bert_dir):
    return train_topics(tmp_path_factory.mktemp("serve-text"), tiny_bert_dir)


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    return train_digits(tmp_path_factory.mktemp("serve-digits"), 10)


def _client(model_dir, adapters=None, api_key=None, **options):
    options = ServeOptions(precision="fp32", **options)
    app = create_worker(model_dir, options, adapters=adapters, api_key=api_key)
    client = TestClient(app)
    client.__enter__()
    deadline = time.monotonic() + 60
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, client.get("/readyz").json()
        time.sleep(0.05)
    return client


@pytest.fixture(scope="module")
def text_endpoint(text_model):
    client = _client(text_model, max_batch=8, max_wait_ms=20)
    yield client
    client.__exit__(None, None, None)


def _offline(model_dir, texts):
    module, tokenizer, manifest = load_artifact(model_dir)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        logits = tasks.forward(built_from(module, manifest), manifest["task"], dict(batch))
    return [manifest["labels"][i] for i in logits.argmax(-1).tolist()], torch.softmax(logits, -1)


@pytest.mark.slow
def test_predict_answers_what_the_model_says_offline(text_endpoint, text_model):
    texts = ["the striker scored twice in the final", "shares fell as the central bank raised rates"]
    response = text_endpoint.post("/predict", json={"inputs": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    labels, probs = _offline(text_model, texts)
    assert [o["label"] for o in body["outputs"]] == labels and body["model"] == "topics"
    for output, row in zip(body["outputs"], probs, strict=True):
        assert output["score"] == pytest.approx(float(row.max()), abs=1e-5)
        assert sum(output["scores"].values()) == pytest.approx(1.0, abs=1e-5)
    one = text_endpoint.post("/predict", json={"inputs": texts[0]}).json()["outputs"]
    assert len(one) == 1 and one[0]["label"] == labels[0]
    info = text_endpoint.get("/info").json()  # --precision fp32: one copy, not timed
    assert info["precision"] == "fp32" and info["precision_choice"]["rule"] == "fp32 for every batch"


def test_concurrent_requests_share_batches(text_endpoint):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(lambda i: text_endpoint.post("/predict", json={"inputs": [f"news {i}"]}), range(32))
        )
    assert all(a.status_code == 200 for a in answers)
    metrics = text_endpoint.get("/metrics").text
    figures = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    count, total = (float(figures[f"gpuforge_serve_batch_size_{k}"]) for k in ("count", "sum"))
    assert total / count > 1.0  # more than one input per batch on average
    for name in ("gpuforge_serve_request_seconds_bucket", "gpuforge_serve_queue_seconds_count",
                 "gpuforge_serve_requests_in_flight", "gpuforge_serve_tokens_total"):  # fmt: skip
        assert name in metrics


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"inputs": []}, 422, "inputs: empty"),
        ({"inputs": [""]}, 422, "inputs[0]: an input is empty"),
        ({"inputs": ["fine", 3]}, 422, "inputs[1]: each input must be a string"),
        ({"inputs": ["x"] * 300}, 413, "300 in one request"),
        ({"text": "no inputs key"}, 422, "inputs"),
        ({"inputs": ["ok"], "adapter": "x", "extra": 1}, 422, "extra"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_the_worker_stays_up(text_endpoint, body, status, words):
    response = text_endpoint.post("/predict", json=body)
    assert response.status_code == status and words in json.dumps(response.json())
    assert text_endpoint.post("/predict", json={"inputs": ["still here"]}).status_code == 200


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data", None]
)
def test_a_json_body_is_read_as_json_whatever_its_content_type_says(text_endpoint, content_type):
    headers = {"content-type": content_type} if content_type else {}  # `curl -d` says a form
    body = b'{"inputs": ["the striker scored twice"]}'
    response = text_endpoint.post("/predict", content=body, headers=headers)
    assert response.status_code == 200 and len(response.json()["outputs"]) == 1, response.text
    not_json = text_endpoint.post("/predict", content=b"inputs=the+striker", headers=headers)
    assert not_json.status_code == 422 and "JSON decode error" in not_json.text


def test_malformed_and_non_utf8_bodies_are_4xx(text_endpoint):
    headers = {"content-type": "application/json"}
    for body in (b'{"inputs": [', b'{"inputs": ["\xff\xfe"]}', b"\x80\x81"):
        response = text_endpoint.post("/predict", content=body, headers=headers)
        assert response.status_code in (400, 422) and response.json()["detail"]
    assert text_endpoint.post("/predict", json={"inputs": ["still here"]}).status_code == 200


def test_an_input_over_the_length_is_truncated_and_says_so(text_endpoint):
    outputs = text_endpoint.post("/predict", json={"inputs": ["goal " * 200, "short one"]}).json()["outputs"]
    assert outputs[0].get("truncated") is True and "truncated" not in outputs[1]


def test_a_bad_input_does_not_disturb_the_others_in_flight(text_endpoint):
    import concurrent.futures

    bodies = [{"inputs": ["match report"]}, {"inputs": [""]}, {"inputs": ["market news"]}] * 5
    with concurrent.futures.ThreadPoolExecutor(15) as pool:
        codes = list(pool.map(lambda b: text_endpoint.post("/predict", json=b).status_code, bodies))
    assert codes == [200, 422, 200] * 5


def test_the_api_key_is_required_when_configured(text_model):
    client = _client(text_model, api_key="secret-key")
    try:
        assert client.post("/predict", json={"inputs": ["x"]}).status_code == 401
        ok = client.post("/predict", json={"inputs": ["x"]}, headers={"Authorization": "Bearer secret-key"})
        assert ok.status_code == 200
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    finally:
        client.__exit__(None, None, None)


def test_images_in_the_training_shape(digits_model):
    from sklearn.datasets import load_digits

    client = _client(digits_model)
    try:
        digits = load_digits()
        images = (digits.images[:4] / 16.0).tolist()  # 8 x 8: the one channel may be left out
        response = client.post("/predict", json={"inputs": images})
        assert response.status_code == 200, response.text
        assert [o["label"] for o in response.json()["outputs"]] != [] and client.get("/info").json()[
            "task"
        ] == ("image-classification")
        wrong = client.post("/predict", json={"inputs": [[[0.0] * 5] * 5]})
        assert wrong.status_code == 422 and "shape [5, 5]" in wrong.json()["detail"]
        assert client.post("/predict", json={"inputs": ["text"]}).status_code == 422
    finally:
        client.__exit__(None, None, None)


def test_readyz_says_why_a_model_cannot_load(tmp_path):
    (tmp_path / "gpuforge.json").write_text("{}")
    client = TestClient(create_worker(tmp_path))
    with client:
        deadline = time.monotonic() + 30
        while (
            "still loading" in (detail := client.get("/readyz").json()["detail"])
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert client.get("/readyz").status_code == 503
        assert "ArtifactError" in detail and "gpuforge.json" in detail  # what is wrong, and where
        assert client.post("/predict", json={"inputs": ["x"]}).status_code == 503
        assert client.get("/healthz").status_code == 200


def test_quantized_at_load_still_answers(text_model):
    client = _client(text_model, quantize="int8")
    try:
        info = client.get("/info").json()
        assert info["quantized"] == "int8"
        report = info["quantize_report"]  # measured at load on the run's held-out split
        assert report["metric"] == "accuracy" and report["examples"] == 24
        assert report["after"] == pytest.approx(report["before"] + report["delta"])
        assert client.post("/predict", json={"inputs": ["a goal in extra time"]}).status_code == 200
    finally:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("kind", ["int8", "int8-dynamic"])
def test_info_names_the_quantization_a_compressed_variant_carries(digits_model, tmp_path, kind):
    from gpuforge.artifact.origin import open_source
    from gpuforge.compress.pipeline import CompressOptions, make_variant, save_variant

    built, tokenizer, manifest = make_variant(open_source(digits_model), CompressOptions(quantize=kind))
    save_variant(built, tokenizer, manifest, tmp_path / "variant")
    for model_dir, quantized in ((tmp_path / "variant", kind), (digits_model, None)):
        client = _client(model_dir)
        try:
            assert client.get("/info").json()["quantized"] == quantized
            assert client.post("/predict", json={"inputs": [[[0.5] * 8] * 8]}).status_code == 200
        finally:
            client.__exit__(None, None, None)


def test_many_adapters_on_one_base_mixed_in_one_batch(three_adapters):
    import concurrent.futures

    own, b, c = three_adapters
    texts = ["the striker scored twice", "shares fell sharply", "a new phone was launched", "rain all week"]
    expected = {name: _offline(path, texts)[1] for name, path in (("default", own), ("b", b), ("c", c))}
    client = _client(own, adapters={"b": b, "c": c}, max_adapters=2, max_batch=16, max_wait_ms=50)
    try:
        assert client.get("/info").json()["adapters"] == ["default", "b", "c"]

        def ask(job):
            name, text_index = job
            body = {"inputs": [texts[text_index]], **({"adapter": name} if name != "default" else {})}
            return name, text_index, client.post("/predict", json=body).json()["outputs"][0]

        jobs = [(name, i) for name in ("default", "b", "c") for i in range(len(texts))] * 2
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            for name, i, output in pool.map(ask, jobs):  # rows of one batch go through their own adapter
                assert output["score"] == pytest.approx(float(expected[name][i].max()), abs=1e-4), (name, i)
        adapters = client.app.state.backend.predictor.adapters
        assert len(adapters.loaded) <= 3 and adapters.loads >= 2  # b and c on first use

        before = adapters.evictions
        for name in ("b", "c", "b"):  # one of b and c at a time: each use of the other evicts
            assert client.post("/predict", json={"inputs": ["x"], "adapter": name}).status_code == 200
        assert adapters.evictions - before >= 2 and set(adapters.loaded) <= {"default", "b", "c"}

        unknown = client.post("/predict", json={"inputs": ["x"], "adapter": "nope"})
        assert unknown.status_code == 404 and "unknown adapter 'nope'" in unknown.json()["detail"]
    finally:
        client.__exit__(None, None, None)


def test_an_adapter_on_another_base_is_refused_before_serving(three_adapters, text_model):
    from gpuforge.errors import GpuforgeError
    from gpuforge.serve.adapters import check_adapters

    with pytest.raises(GpuforgeError, match="a full model, not a LoRA adapter"):
        check_adapters(three_adapters[0], {"full": text_model})
    with pytest.raises(GpuforgeError, match="is a full model; serve an adapter"):
        check_adapters(text_model, {"b": three_adapters[1]})


def test_a_request_is_taken_whole_or_refused_whole(text_model):
    client = _client(text_model, max_queue=4, max_batch=2, max_wait_ms=1)
    try:
        too_big = client.post("/predict", json={"inputs": ["a"] * 5})
        assert too_big.status_code == 413 and "over the 4 allowed" in too_big.json()["detail"]
        assert client.post("/predict", json={"inputs": ["a"] * 4}).status_code == 200
    finally:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_completion_asked_of_a_classifier_says_what_it_is_and_what_to_call(text_endpoint, path):
    response = text_endpoint.post(path, json={"prompt": "the striker", "max_tokens": 4})
    assert response.status_code == 404, response.text
    said = response.json()
    assert said["error"]["message"] == said["detail"]  # OpenAI clients read the one, ours the other
    assert said["detail"].startswith("this model is a classifier (sequence-classification), not a causal LM")
    assert "POST /predict" in said["detail"]


def test_predict_keeps_the_frameworks_error_shape_and_stays_documented(text_endpoint):
    missing = text_endpoint.post("/predict", json={})
    (error,) = missing.json()["detail"]
    assert missing.status_code == 422 and error["loc"] == ["body", "inputs"] and error["type"] == "missing"
    not_json = text_endpoint.post(
        "/predict", content=b'{"inputs": [', headers={"content-type": "application/json"}
    )
    (error,) = not_json.json()["detail"]
    assert error["type"] == "json_invalid" and error["loc"][0] == "body"
    empty = text_endpoint.post("/predict", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 422 and empty.json()["detail"][0]["loc"] == ["body"]
    for unreadable in (b"[" * 5000, b"\x80\x81"):  # nested past the parser's depth; not UTF-8
        response = text_endpoint.post(
            "/predict", content=unreadable, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400 and "error parsing the body" in response.json()["detail"]
    schema = text_endpoint.get("/openapi.json").json()
    assert "/predict" in schema["paths"] and "post" in schema["paths"]["/predict"]
    assert text_endpoint.get("/predict").status_code == 405  # only POST is answered below the framework
