"""What the endpoint worker refuses before reading a body: a request without the key (401), a body over
--max-body-bytes (413); which routes need the key; where the key comes from (never the command line).

In process: the worker's ASGI app called with a receive that counts what the app asks for, and Starlette's
TestClient. As a process: `gpuforge serve` on loopback, spoken to over a raw socket, so a test can send a
request's headers and hold back its body."""

import asyncio
import json
import socket
import time

import pytest
from fastapi.testclient import TestClient

from gpuforge.serve.options import ServeOptions
from gpuforge.serve.worker import create_worker
from tests.helpers.serving import start_serve as _serve
from tests.serve.tiny_runs import train_digits, train_gpt

KEY = "gf_worker-key-0123456789abcdef"
GIB = 1 << 30


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    return train_digits(tmp_path_factory.mktemp("limits-digits"), 4)


@pytest.fixture(scope="module")
def lm_model(tmp_path_factory):
    return train_gpt(tmp_path_factory.mktemp("limits-gpt"))


def _image():
    from sklearn.datasets import load_digits

    return (load_digits().images[0] / 16.0).tolist()


# -- the ASGI app itself: what it asks of `receive` -----------------------------------------------------


def _asgi(app, path, headers, chunk=b"", method="POST"):
    """One request straight through the app, its body an endless run of `chunk`: (status, JSON body, how
    many times the app awaited receive)."""
    awaited, sent = 0, []

    async def receive():
        nonlocal awaited
        awaited += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8700),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # one answer
    return start["status"], json.loads(body), awaited, dict(start["headers"])


@pytest.mark.parametrize("path", ["/predict", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "key_headers", [{}, {"Authorization": "Bearer wrong"}, {"X-API-Key": KEY[:-1]}, {"Authorization": KEY}]
)
def test_without_the_key_the_body_is_never_read(lm_model, path, key_headers):
    app = create_worker(lm_model, ServeOptions(max_body_bytes=1024), api_key=KEY)
    for how in ({"Content-Length": str(GIB)}, {"Transfer-Encoding": "chunked"}):
        code, body, awaited, headers = _asgi(app, path, {**key_headers, **how}, b"x" * 4096)
        assert (code, awaited) == (401, 0)  # not 413: nothing of the body, not even its length, counted
        assert headers[b"www-authenticate"] == b"Bearer" and headers[b"connection"] == b"close"
        if path.startswith("/v1/"):  # where OpenAI clients look
            assert body["error"]["type"] == "authentication_error"
        assert "missing or wrong API key" in body["detail"]


def test_a_body_over_the_limit_is_refused_by_its_length_or_as_soon_as_it_passes_it(lm_model):
    app = create_worker(lm_model, ServeOptions(max_body_bytes=10_000), api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/predict", "/v1/completions"):
        code, body, awaited, _ = _asgi(app, path, {**auth, "Content-Length": str(GIB)}, b"x")
        assert (code, awaited) == (413, 0) and f"body of {GIB} bytes" in body["detail"]
        code, body, awaited, headers = _asgi(app, path, {**auth, "Transfer-Encoding": "chunked"}, b"x" * 4096)
        assert (code, awaited) == (413, 3)  # 12,288 bytes read: past 10,000, and not a message more
        assert "over the 10000 allowed" in body["detail"] and headers[b"connection"] == b"close"
    assert body["error"]["type"] == "invalid_request_error"


def test_without_a_key_configured_only_the_limit_applies(digits_model):
    app = create_worker(digits_model, ServeOptions(max_body_bytes=1024))
    code, _, awaited, _ = _asgi(app, "/predict", {"Content-Length": str(GIB)})
    assert (code, awaited) == (413, 0)
    code, _, awaited, _ = _asgi(app, "/predict", {"Transfer-Encoding": "chunked"}, b"x" * 1000)
    assert (code, awaited) == (413, 2)


# -- through TestClient: the routes that answer with the key ---------------------------------------------


def _ready(client):
    deadline = time.monotonic() + 60
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, client.get("/readyz").json()
        time.sleep(0.05)
    return client


@pytest.mark.parametrize("public", [False, True])
def test_metrics_and_docs_need_the_key_unless_public(digits_model, public):
    app = create_worker(digits_model, ServeOptions(precision="fp32"), api_key=KEY, public_metrics=public)
    with TestClient(app) as client:
        _ready(client)
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc"):
            assert client.get(path).status_code == (200 if public else 401), path
            assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert client.get(path, headers={"X-API-Key": KEY}).status_code == 200
        for path in ("/predict", "/info"):  # public metrics open nothing else
            assert client.request("GET" if path == "/info" else "POST", path).status_code == 401
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200


def test_with_the_key_and_under_the_limit_everything_answers(digits_model, lm_model):
    image = _image()
    app = create_worker(digits_model, ServeOptions(precision="fp32", max_body_bytes=2000), api_key=KEY)
    with TestClient(app, headers={"X-API-Key": KEY}) as client:
        _ready(client)
        assert client.post("/predict", json={"inputs": [image]}).status_code == 200
        assert client.get("/info").json()["task"] == "image-classification"
        over = client.post("/predict", json={"inputs": [image] * 10})  # about 4 KB
        assert over.status_code == 413 and "over the 2000 allowed" in over.json()["detail"]
        assert client.post("/predict", json={"inputs": [image]}).status_code == 200  # and it stays up
    app = create_worker(lm_model, ServeOptions(precision="fp32", max_batch=2), api_key=KEY)
    with TestClient(app) as client:
        _ready(client)
        body = {"prompt": "def add", "max_tokens": 2, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 401
        answer = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers={"X-API-Key": KEY}).status_code == 200
        assert client.get("/v1/models").status_code == 401


# -- `gpuforge serve` as a process: a raw socket, headers sent, the body held back -------------------------


def _exchange(url, head: str, body: bytes = b"") -> tuple[int, str]:
    """Send a request's head (and the start of its body), never its end; (status, the answer) once the
    server has answered and closed the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its refusal
            answer += chunk
    text = answer.decode()
    return int(text.split(" ", 2)[1]), text


@pytest.mark.slow
def test_a_served_model_refuses_before_the_body_arrives(digits_model):
    process, url = _serve(digits_model, "--max-body-bytes", "1000", env={"GPUFORGE_API_KEY": KEY})
    try:
        post = "POST /predict HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        code, text = _exchange(url, post + f"Content-Length: {GIB}\n")  # no key: not one byte sent
        assert code == 401 and "missing or wrong API key" in text
        code, text = _exchange(url, post + f"X-API-Key: nope\nContent-Length: {GIB}\n")
        assert code == 401
        code, text = _exchange(url, post + f"Authorization: Bearer {KEY}\nContent-Length: {GIB}\n")
        assert code == 413 and f"body of {GIB} bytes" in text
        chunked = post + f"Authorization: Bearer {KEY}\nTransfer-Encoding: chunked\n"
        two_chunks = (b"320\r\n" + b"x" * 800 + b"\r\n") * 2  # 1,600 bytes, and no last chunk
        code, text = _exchange(url, chunked, two_chunks)
        assert code == 413 and "over the 1000 allowed" in text  # before the body's end was sent
        completions = "POST /v1/completions HTTP/1.1\nHost: x\n"
        code, text = _exchange(url, completions + f"Content-Length: {GIB}\n")
        assert code == 401 and "authentication_error" in text
        ok = _serve_ask(url, {"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and len(ok.json()["outputs"]) == 1  # still answering
        assert _serve_ask(url, {}).status_code == 401
    finally:
        process.kill()


def _serve_ask(url, headers):
    import httpx

    return httpx.post(f"{url}/predict", json={"inputs": [_image()]}, headers=headers, timeout=30)


@pytest.mark.slow
def test_the_key_from_a_file_and_public_metrics(digits_model, tmp_path):
    import httpx

    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}  \nsecond line is not the key\n")
    env = {"GPUFORGE_API_KEY": "not-this-one", "GPUFORGE_PUBLIC_METRICS": "TRUE"}
    process, url = _serve(digits_model, "--api-key-file", str(key_file), env=env)
    try:
        assert _serve_ask(url, {"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert _serve_ask(url, {"Authorization": "Bearer not-this-one"}).status_code == 401
        assert _serve_ask(url, {}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 200  # public, as asked
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        assert httpx.get(f"{url}/info").status_code == 401
    finally:
        process.kill()
