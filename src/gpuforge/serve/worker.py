"""An endpoint: one trained model behind HTTP, its requests gathered into batches (serve/batcher.py).

    gpuforge serve runs/<id>/model --port 8700 --max-batch 32 --max-wait-ms 5 [--quantize int8]
    GPUFORGE_API_KEY=... gpuforge serve runs/<id>/model --host 0.0.0.0     # or --api-key-file PATH
    app = create_worker(Path("runs/<id>/model"), ServeOptions(max_batch=8))   # in process (tests)

    POST /predict   {"inputs": ["great film", ...]}  ->  {"model", "outputs": [{"label", "score", "scores"}]}
    POST /v1/completions, /v1/chat/completions     a causal LM instead (serve/openai_api.py); a
                    classifier answers them 404, saying it is one and to POST /predict
    GET  /info      what is served (task, labels or context length, precision, batching, adapters, and
                    with --eval-at-load the eval metric as served, measured before /readyz turns 200)
    POST /admin/adapters, DELETE /admin/adapters/{name}   LoRA adapters added to a running classifier or
                    removed from it (--adapters-root; serve/classifier_backend.py)
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

The routes are the same for every model; what they answer comes from a Backend (serve/endpoint.py): a
classifier's (serve/classifier_backend.py) or a causal LM's (serve/generator_backend.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import generate_latest

from gpuforge.access import DOCUMENT_PATHS, OPEN_PATHS
from gpuforge.artifact import ArtifactError, Manifest, read_manifest
from gpuforge.serve.classifier_backend import ClassifierBackend
from gpuforge.serve.endpoint import Backend, Info, PredictRequest, PredictResponse, Status
from gpuforge.serve.gate import Gate
from gpuforge.serve.generator_backend import GeneratorBackend
from gpuforge.serve.metrics import ServeMetrics
from gpuforge.serve.options import ServeOptions
from gpuforge.serve.predict_route import PATH as PREDICT_PATH
from gpuforge.serve.predict_route import PredictRoute


def create_worker(
    model_dir: Path,
    options: ServeOptions | None = None,
    *,
    api_key: str | None = None,
    public_metrics: bool = False,
    adapters: dict[str, Path] | None = None,
) -> FastAPI:
    """The worker's app for the model in `model_dir`. `api_key`: what clients must present (see Gate);
    `public_metrics`: /metrics and the API docs open without it; `adapters`: more LoRA adapters on the
    served base, by name."""
    options = options or ServeOptions()
    metrics = ServeMetrics()
    backend = backend_for(Path(model_dir), options, metrics, adapters or {})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.get_running_loop().create_task(backend.load())
        yield
        loading.cancel()
        await backend.stop()

    app = FastAPI(title="gpuforge endpoint", version="0.1.0", lifespan=lifespan)
    app.state.backend = backend
    backend.install(app)
    app.add_middleware(PredictRoute, backend=backend)  # inside the Gate: it answers POST /predict itself
    app.add_middleware(
        Gate, api_key=api_key, max_body_bytes=options.max_body_bytes,
        open_paths=OPEN_PATHS | (DOCUMENT_PATHS if public_metrics else frozenset()),
    )  # fmt: skip

    @app.post(PREDICT_PATH, response_model=PredictResponse)
    async def predict(body: PredictRequest, request: Request) -> Response:
        """Labels and scores for one input or many; inputs of one request may share a batch with others'.
        (Documented here; answered by PredictRoute, serve/predict_route.py, before the request gets here.)"""
        return await backend.predict(body, request)

    @app.get("/info", response_model=Info)
    def info() -> Info:
        """What this endpoint serves and how it batches."""
        return backend.info()

    @app.get("/healthz", response_model=Status)
    def healthz() -> Status:
        """The process answers."""
        return Status(status="ok")

    @app.get("/readyz", response_model=Status)
    def readyz() -> Status:
        """The model is loaded and warmed up."""
        backend.ready()
        return Status(status="ready")

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        """Prometheus text."""
        backend.update_metrics()
        return generate_latest(metrics.registry).decode()

    return app


def backend_for(
    model_dir: Path, options: ServeOptions, metrics: ServeMetrics, adapters: dict[str, Path]
) -> Backend:
    """A causal LM's model generates; any other task's is classified. A manifest that cannot be read
    makes a classifier too: its load says what is wrong, on /readyz."""
    manifest = _manifest(model_dir)
    if manifest is not None and manifest.task == "causal-lm" and _generates(manifest):
        quantized = manifest.quantization or (manifest.onnx.quantize if manifest.onnx else None)
        return GeneratorBackend(model_dir, options, metrics, quantized)
    return ClassifierBackend(model_dir, options, metrics, adapters)


def _generates(manifest: Manifest) -> bool:
    """An ONNX export of a causal LM generates where it was exported with its key/value cache; one of its
    logits alone cannot, and the classifier's load says so."""
    return manifest.format != "onnx" or (manifest.onnx is not None and manifest.onnx.cache is not None)


def _manifest(model_dir: Path) -> Manifest | None:
    try:
        return read_manifest(model_dir)
    except ArtifactError:
        return None  # the load says what is wrong, on /readyz
