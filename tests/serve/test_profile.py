"""POST /admin/profile on a worker serving a real (tiny BERT) classifier: where a served input's time went
over a window, split into queue, tokenize, forward, scores and respond; and on one serving a real (tiny
GPT) causal LM: a request's time in the continuous batches, split into queue, tokenize, prefill, joins,
decode, sample and host."""

import concurrent.futures
import time

import pytest

from tests.serve.test_worker import _client
from tests.serve.tiny_runs import train_gpt, train_topics


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, tiny_bert_dir):
    client = _client(
        train_topics(tmp_path_factory.mktemp("profiled"), tiny_bert_dir), max_batch=8, max_wait_ms=20
    )
    yield client
    client.__exit__(None, None, None)


def _ask(client, i: int) -> float:
    began = time.perf_counter()
    assert client.post("/predict", json={"inputs": [f"the market fell {i}"]}).status_code == 200
    return time.perf_counter() - began


@pytest.mark.slow
def test_a_window_splits_the_mean_inputs_latency_into_its_parts(endpoint):
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        window = pool.submit(endpoint.post, "/admin/profile", params={"seconds": 3})
        time.sleep(0.3)  # the window is open
        busy = endpoint.post("/admin/profile", params={"seconds": 1})
        latencies = list(pool.map(lambda i: _ask(endpoint, i), range(48)))
        answer = window.result()
    assert busy.status_code == 409 and "open already" in busy.json()["detail"]
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["inputs"] == report["requests"] == 48 and report["mean_batch"] > 1  # they shared batches
    parts = report["breakdown"]
    assert set(parts) == {"queue", "tokenize", "forward", "scores", "respond", "other"}
    assert all(parts[name]["seconds"] > 0 for name in ("tokenize", "forward", "scores", "respond"))
    assert abs(sum(p["share"] for p in parts.values()) - 1) < 1e-9
    # what the server saw of an input is inside what its client waited (the client's own HTTP on top)
    assert report["mean_input_s"] < sum(latencies) / len(latencies), (report["mean_input_s"], latencies)


def test_a_window_with_no_request_says_so_and_bad_windows_are_refused(endpoint):
    quiet = endpoint.post("/admin/profile", params={"seconds": 0.2}).json()
    assert quiet["inputs"] == 0 and quiet["breakdown"] is None and "no request was answered" in quiet["note"]
    for seconds in (0, -1, 61, "soon"):
        assert endpoint.post("/admin/profile", params={"seconds": seconds}).status_code == 422


@pytest.fixture(scope="module")
def lm_endpoint(tmp_path_factory):
    client = _client(train_gpt(tmp_path_factory.mktemp("profiled-gpt"), "gpt-profiled"), max_batch=8)
    yield client
    client.__exit__(None, None, None)


def _complete(client, i: int, max_tokens: int = 12) -> tuple[float, int]:
    """(the client's wait, the tokens generated) for one completion."""
    began = time.perf_counter()
    body = {"prompt": f"def f{i}(x):", "max_tokens": max_tokens, "temperature": 0}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - began, answer.json()["usage"]["completion_tokens"]


@pytest.mark.slow
def test_a_causal_lms_window_splits_the_mean_requests_time_in_its_continuous_batches(lm_endpoint):
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        before = pool.submit(_complete, lm_endpoint, 99, 60)  # submitted before the window: not in it
        time.sleep(0.2)
        window = pool.submit(lm_endpoint.post, "/admin/profile", params={"seconds": 4})
        time.sleep(0.5)  # the window is open
        # one request ends at its prefill (a single token), the others run 12 steps
        asked = [1, *[12] * 19]
        latencies, tokens = zip(
            *pool.map(lambda i: _complete(lm_endpoint, i, asked[i]), range(20)), strict=True
        )
        before.result()
        answer = window.result()
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["requests"] == 20 and report["tokens"] == sum(tokens)
    # requests shared the running batch
    assert report["decode_steps"] >= max(tokens) - 1 and report["mean_batch"] > 1
    parts = report["breakdown"]
    assert set(parts) == {"queue", "tokenize", "prefill", "joins", "decode", "sample", "host", "other"}
    measured = ("queue", "tokenize", "prefill", "decode", "sample", "host")
    assert all(parts[name]["seconds"] > 0 for name in measured), parts
    assert parts["joins"]["seconds"] > 0  # newcomers' prefills held the running ones up
    assert parts["other"]["share"] < 0.3, parts  # the named parts are most of a request's time
    assert abs(sum(p["share"] for p in parts.values()) - 1) < 1e-9
    assert report["mean_request_s"] < sum(latencies) / len(latencies)
    quiet = lm_endpoint.post("/admin/profile", params={"seconds": 0.2}).json()
    assert quiet["requests"] == 0 and quiet["breakdown"] is None and "no request" in quiet["note"]
