"""An endpoint: one trained model behind HTTP, its requests gathered into batches (serve/batcher.py).

    gpuforge serve runs/<id>/model --port 8700 --max-batch 32 --max-wait-ms 5 [--quantize int8]
    GPUFORGE_API_KEY=... gpuforge serve runs/<id>/model --host 0.0.0.0     # or --api-key-file PATH

    POST /predict   {"inputs": ["great film", ...]}  ->  {"model", "outputs": [{"label", "score", "scores"}]}
    POST /v1/completions, /v1/chat/completions     a causal LM instead (serve/openai_api.py)
    GET  /info      what is served (task, labels or context length, precision, batching)
    GET  /healthz   the process answers;  /readyz: the model is loaded and warmed up (503 before)
    GET  /metrics   Prometheus: request latency, queue time, batch sizes, inputs, tokens, in flight

The model loads in the background after the server starts listening, so /healthz answers at once and
/readyz turns 200 only after a warm-up. Backpressure: the queue holds at most `max_queue` inputs; past it
a request gets 429 with Retry-After, never an unbounded wait. A request past `timeout_s` gets 504, and a
client that goes away frees its place (its inputs are dropped before they reach the model). On SIGTERM
the server stops accepting, answers what it holds, then exits.

Who may send what is decided before a byte of a body is read (`Gate`): with a key, every route but
/healthz and /readyz needs it (`Authorization: Bearer <key>` or `X-API-Key`; 401 otherwise), /metrics and
the API docs too unless GPUFORGE_PUBLIC_METRICS is true; a body over `max_body_bytes` gets 413, at once
by its Content-Length or as soon as the bytes of a chunked one pass the limit. Every body it takes is
JSON, read as JSON whatever its Content-Type says (curl's `-d` says a form).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from gpuforge.access import DOCUMENT_PATHS, OPEN_PATHS, carries_body, presented_key
from gpuforge.errors import GpuforgeError
from gpuforge.serve.batcher import Batcher, BatchStats, QueueFull
from gpuforge.serve.predict import InputError, Predictor, load_predictor, quantization_of

log = logging.getLogger("gpuforge.serve")
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _freeze_garbage() -> None:
    """Move what loading made (~440k objects of torch and transformers) out of the collector's sight: a
    full collection over them paused every request for 215-254 ms; with them frozen, 1-9 ms."""
    gc.collect()
    gc.freeze()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class ServeConfig:
    model_dir: Path
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 256  # inputs waiting; past it 429
    timeout_s: float = 30.0
    max_inputs: int = 256  # per request
    api_key: str | None = None  # clients must present it (see Gate)
    max_body_bytes: int = 1 << 20  # a request body over it: 413, before it is read
    public_metrics: bool = False  # /metrics and the API docs open without the key
    quantize: str | None = None
    precision: str = "auto"
    device: str = "auto"
    max_length: int | None = None
    adapters: dict[str, Path] = field(default_factory=dict)  # more LoRA adapters on the served base
    max_adapters: int = 8  # loaded at once; the least recently used goes first


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: list[Any] | str = Field(description="texts (or images as nested lists of numbers); one or many")
    adapter: str | None = Field(None, description="the LoRA adapter to answer with (default: the served one)")


class Prediction(BaseModel):
    model_config = ConfigDict(extra="allow")  # `truncated: true` when an input was cut to max_length

    label: str
    score: float
    scores: dict[str, float]


class PredictResponse(BaseModel):
    model: str
    outputs: list[Prediction]


class Status(BaseModel):
    status: str


class Info(BaseModel):
    model: str
    task: str
    labels: list[str]
    device: str
    precision: str
    quantized: str | None = Field(description="int8, int4 or int8-dynamic (--quantize, gpuforge compress)")
    max_length: int | None = Field(description="tokens a text input is cut to")
    context_length: int | None = Field(None, description="a causal LM's: prompt + max_tokens fit in it")
    batching: str = Field(
        description="dynamic (requests within max_wait_ms share a batch) or continuous (a causal LM's: "
        "requests join and leave the running batch at every step)"
    )
    max_batch: int
    max_wait_ms: float | None = Field(description="how long a dynamic batch waits to fill")
    max_queue: int
    adapters: list[str]
    quantize_report: dict[str, Any] | None = Field(
        None, description="eval metric before and after --quantize"
    )


class _Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.latency = Histogram(
            "gpuforge_serve_request_seconds", "request latency", buckets=buckets, registry=r
        )
        self.queue = Histogram(
            "gpuforge_serve_queue_seconds", "an input's wait for its batch", buckets=buckets, registry=r
        )
        sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch = Histogram("gpuforge_serve_batch_size", "inputs per batch", buckets=sizes, registry=r)
        self.inputs = Counter("gpuforge_serve_inputs", "inputs answered", registry=r)
        self.tokens = Counter("gpuforge_serve_tokens", "tokens the model read", registry=r)
        self.in_flight = Gauge("gpuforge_serve_requests_in_flight", "requests being answered", registry=r)
        self.rejected = Counter("gpuforge_serve_rejected", "requests refused", ["reason"], registry=r)
        self.queued = Gauge("gpuforge_serve_queue_length", "inputs waiting for a batch", registry=r)

    def batch_done(self, stats: BatchStats) -> None:
        self.batch.observe(stats.size)
        for seconds in stats.queue_seconds:
            self.queue.observe(seconds)


def create_worker(config: ServeConfig) -> FastAPI:
    metrics = _Metrics()
    manifest = _manifest(config.model_dir)
    generates = manifest.get("task") == "causal-lm"  # completions (serve/generate.py), not /predict

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.predictor, app.state.batcher, app.state.load_error = None, None, None
        app.state.engine, app.state.tokens_counted = None, 0
        loading = asyncio.get_running_loop().create_task(_load_engine(app) if generates else _load(app))
        yield
        loading.cancel()
        if app.state.batcher is not None:
            await app.state.batcher.stop()  # answers what is queued before the process exits
        if app.state.engine is not None:
            await asyncio.to_thread(app.state.engine.stop)  # finishes the generations under way

    async def _load_engine(app: FastAPI) -> None:
        from gpuforge.serve.generate import load_engine

        try:
            if config.quantize:
                raise GpuforgeError("--quantize: this release quantizes classifiers only")
            engine = await asyncio.to_thread(
                load_engine, config.model_dir, config.device, config.precision, config.max_batch,
                config.max_queue,
            )  # fmt: skip
            _freeze_garbage()
            engine.start()
        except Exception as err:  # the process stays up to say why on /readyz
            log.exception("loading %s failed", config.model_dir)
            app.state.load_error = f"{type(err).__name__}: {err}"
            return
        app.state.engine = engine
        log.info("ready: %s", config.model_dir)

    async def _load(app: FastAPI) -> None:
        try:
            predictor = await asyncio.to_thread(
                load_predictor, config.model_dir, config.device, config.precision, config.quantize,
                config.max_length, config.adapters, config.max_adapters,
            )  # fmt: skip
            await asyncio.to_thread(predictor.warm_up, (1, min(8, config.max_batch), config.max_batch))
            _freeze_garbage()
        except Exception as err:  # the process stays up to say why on /readyz
            log.exception("loading %s failed", config.model_dir)
            app.state.load_error = f"{type(err).__name__}: {err}"
            return

        def run_batch(items):
            before = predictor.tokens_read
            results = predictor.run_batch(items)
            metrics.inputs.inc(len(items))
            metrics.tokens.inc(predictor.tokens_read - before)  # counted by the tokenizer, not guessed
            return results

        batcher = Batcher(
            run_batch, config.max_batch, config.max_wait_ms, config.max_queue, metrics.batch_done
        )
        await batcher.start()
        app.state.predictor, app.state.batcher = predictor, batcher
        log.info("ready: %s", config.model_dir)

    app = FastAPI(title="gpuforge endpoint", version="0.1.0", lifespan=lifespan)
    if generates:  # inside the Gate: a request it refuses is not counted, as on /predict
        app.add_middleware(CountedCompletions, metrics=metrics)
    app.add_middleware(
        Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
        open_paths=OPEN_PATHS | (DOCUMENT_PATHS if config.public_metrics else frozenset()),
    )  # fmt: skip

    if generates:
        from gpuforge.serve.openai_api import create_openai_router

        app.include_router(create_openai_router(lambda: app.state.engine))

    def ready_predictor(request: Request) -> Predictor:
        predictor = request.app.state.predictor
        if generates and request.app.state.engine is not None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, "a causal-lm: POST /v1/completions or /v1/chat/completions"
            )
        if predictor is None:
            why = request.app.state.load_error or "the model is still loading"
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, why, headers={"Retry-After": "5"})
        return predictor

    @app.post("/predict", response_model=PredictResponse)
    async def predict(body: PredictRequest, request: Request) -> Response:
        """Labels and scores for one input or many; inputs of one request may share a batch with others'."""
        started = time.perf_counter()
        predictor = ready_predictor(request)
        inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if not inputs:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "inputs: empty; send at least one")
        allowed = min(config.max_inputs, config.max_queue)
        if len(inputs) > allowed:
            too_many = f"inputs: {len(inputs)} in one request, over the {allowed} allowed"
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, too_many)
        adapter = body.adapter
        if adapter is not None and not (predictor.adapters and predictor.adapters.known(adapter)):
            served = ", ".join(predictor.adapters.names()) if predictor.adapters else "none"
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"adapter: unknown adapter {adapter!r} (served: {served})"
            )
        items = []
        for i, raw in enumerate(inputs):
            try:
                items.append((adapter, predictor.check(raw)))
            except InputError as err:
                raise HTTPException(err.status, f"inputs[{i}]: {err}") from None
        metrics.in_flight.inc()
        try:
            request.app.state.batcher.room_for(len(items))  # all of them, or none: a 429 runs nothing
            outputs = await _answer(request, request.app.state.batcher, items)
        except QueueFull as err:
            metrics.rejected.labels("queue full").inc()
            return JSONResponse({"detail": str(err)}, status.HTTP_429_TOO_MANY_REQUESTS,
                                headers={"Retry-After": str(math.ceil(err.retry_after_s))})  # fmt: skip
        except ClientGone:
            return JSONResponse({"detail": "client closed the request"}, 499)  # nobody reads it
        except TimeoutError:
            metrics.rejected.labels("timeout").inc()
            return JSONResponse(
                {"detail": f"no answer within {config.timeout_s:g} s"}, status.HTTP_504_GATEWAY_TIMEOUT
            )
        finally:
            metrics.in_flight.dec()
            metrics.queued.set(request.app.state.batcher.queued)
        metrics.latency.observe(time.perf_counter() - started)
        # the outputs are built by our own code in PredictResponse's shape: sent as they are, not validated
        # again (that cost ~10% of a request's CPU time under load)
        body = json.dumps({"model": predictor.name, "outputs": outputs}, separators=(",", ":"))
        return Response(body, media_type="application/json")

    async def _answer(request: Request, batcher: Batcher, items: list[Any]) -> list[dict[str, Any]]:
        """The batcher's results for `items`; a client that disconnects first cancels them. The body is
        read, so the next ASGI message is the disconnect: one waiting task per request, no polling."""
        if len(items) == 1:
            work = asyncio.ensure_future(batcher.submit(items[0], config.timeout_s))
        else:
            work = asyncio.ensure_future(
                asyncio.gather(*(batcher.submit(i, config.timeout_s) for i in items))
            )
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            metrics.rejected.labels("client gone").inc()
            raise ClientGone
        result = work.result()
        return [result] if len(items) == 1 else result

    @app.get("/info", response_model=Info)
    def info(request: Request) -> Info:
        """What this endpoint serves and how it batches."""
        engine = request.app.state.engine
        if engine is not None:
            return Info(
                model=engine.name, task="causal-lm", labels=[], device=str(engine.device),
                precision=engine.precision.name, quantized=quantization_of(manifest), max_length=None,
                context_length=engine.context, batching="continuous", max_batch=engine.max_batch,
                max_wait_ms=None, max_queue=engine.max_queue, adapters=[],
            )  # fmt: skip
        p = ready_predictor(request)
        return Info(
            model=p.name, task=p.task, labels=p.labels, device=str(p.device), precision=p.precision.name,
            quantized=p.quantized, max_length=p.max_length, batching="dynamic", max_batch=config.max_batch,
            max_wait_ms=config.max_wait_ms, max_queue=config.max_queue,
            adapters=p.adapters.names() if p.adapters else [], quantize_report=p.quantize_report,
        )  # fmt: skip

    @app.get("/healthz", response_model=Status)
    def healthz() -> Status:
        """The process answers."""
        return Status(status="ok")

    @app.get("/readyz", response_model=Status)
    def readyz(request: Request) -> Status:
        """The model is loaded and warmed up."""
        if request.app.state.engine is None:
            ready_predictor(request)
        return Status(status="ready")

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus(request: Request) -> str:
        """Prometheus text."""
        if request.app.state.batcher is not None:
            metrics.queued.set(request.app.state.batcher.queued)
        engine = request.app.state.engine
        if engine is not None:  # generated tokens, counted by the engine
            metrics.tokens.inc(engine.tokens - request.app.state.tokens_counted)
            request.app.state.tokens_counted = engine.tokens
            metrics.queued.set(engine.queued)
        return generate_latest(metrics.registry).decode()

    return app


class Gate:
    """Before the app reads a byte of a body: 401 for a request without the key (when there is one) to
    a path not in `open_paths`, then 413 for a body over `max_body_bytes`, at once by its Content-Length,
    or for a body sent in chunks as soon as the bytes received pass the limit. FastAPI reads a body before
    it runs a route's dependencies, so a key checked there comes too late; @app.middleware("http") would
    wrap every request and response in extra tasks. A refusal closes the connection when a body was on its
    way, so the rest of it is never read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, open_paths: frozenset[str]):
        self.app, self.limit, self.open_paths = app, max_body_bytes, open_paths
        self.key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names lower-case (ASGI)
        length = headers.get(b"content-length", b"")
        has_body = carries_body(headers)
        if self.key is not None and scope["path"] not in self.open_paths and not self._has_key(headers):
            return await _refuse(scope, send, 401, "missing or wrong API key", has_body,
                                 {"WWW-Authenticate": "Bearer"})  # fmt: skip
        if length.isdigit() and int(length) > self.limit:
            return await _refuse(scope, send, 413, self._too_large(int(length)), has_body)
        if has_body and not _says_json(headers.get(b"content-type", b"")):
            scope = _read_as_json(scope)
        received, started, refused = 0, False, False

        async def counted():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # the route reads no further: to it, the client has gone
                refused = True
                if not started:
                    await _refuse(scope, send, 413, self._too_large(received), True)
                return {"type": "http.disconnect"}
            return message

        async def answering(message):
            nonlocal started
            if refused:
                return  # the 413 is sent; what the route answers to the "disconnect" goes nowhere
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, answering)

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        authorization, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        given = presented_key(
            authorization and authorization.decode("latin-1"), x_api_key and x_api_key.decode("latin-1")
        )
        return given is not None and hmac.compare_digest(given.encode("latin-1"), self.key)

    def _too_large(self, size: int) -> str:
        return f"body of {size} bytes or more is over the {self.limit} allowed (--max-body-bytes)"


async def _refuse(scope, send, code: int, message: str, has_body: bool, headers=None) -> None:
    """Answer `code` without reading the body; with one on its way, the connection closes after."""
    headers = {**(headers or {}), **({"Connection": "close"} if has_body else {})}
    if scope["path"].startswith("/v1/"):  # OpenAI clients read the error where they look for it
        from gpuforge.serve.openai_api import error_response

        response = error_response(code, message, headers)
    else:
        response = JSONResponse({"detail": message}, code, headers=headers)
    await response(scope, _no_body, send)


async def _no_body():
    raise RuntimeError("a refused request's body is not read")


def _says_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _read_as_json(scope):
    """The request with `Content-Type: application/json`: every body this worker takes is JSON, and
    `curl -d` (the README's example) says application/x-www-form-urlencoded, which FastAPI would hand the
    route as bytes (422, "Input should be a valid dictionary"). A body that is not JSON stays a 422."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


class CountedCompletions:
    """/v1/completions and /v1/chat/completions in /metrics as /predict is: in flight, latency (a stream's
    until its last byte), inputs answered, refusals. Around the routes rather than in them, so that a
    streamed answer is timed to its end without the routes knowing about metrics."""

    def __init__(self, app, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in COMPLETION_PATHS:
            return await self.app(scope, receive, send)
        started, code = time.perf_counter(), None

        async def answering(message):
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, answering)
        finally:
            self.metrics.in_flight.dec()
        if code == 200:
            self.metrics.latency.observe(time.perf_counter() - started)
            self.metrics.inputs.inc()
        elif code in (429, 499):
            self.metrics.rejected.labels("queue full" if code == 429 else "client gone").inc()


def _manifest(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "gpuforge.json").read_text())
    except (OSError, ValueError):
        return {}  # the load says what is wrong, on /readyz
