"""A causal LM behind OpenAI's routes (serve/openai_api.py): a GenerationEngine (serve/generate.py) that
batches continuously (requests join and leave the running batch at every step). /predict is not for it
(404); its completions are counted in /metrics as predictions are."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request, Response, status

from gpuforge.errors import GpuforgeError
from gpuforge.serve.endpoint import Info, LoadState, PredictRequest, freeze_garbage
from gpuforge.serve.generate import GenerationEngine, load_engine
from gpuforge.serve.metrics import ServeMetrics
from gpuforge.serve.openai_api import create_openai_router
from gpuforge.serve.options import ServeOptions
from gpuforge.serve.profile import MAX_SECONDS

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class GeneratorBackend:
    """Completions and chat answers from one causal LM; `quantized`: what its manifest says it carries."""

    def __init__(self, model_dir: Path, options: ServeOptions, metrics: ServeMetrics, quantized: str | None):
        self.model_dir, self.options, self.metrics, self.quantized = model_dir, options, metrics, quantized
        self.loading = LoadState(model_dir)
        self.engine: GenerationEngine | None = None
        self.tokens_counted = 0  # of the engine's, already in the metrics

    def install(self, app: FastAPI) -> None:
        app.add_middleware(CountedCompletions, metrics=self.metrics)  # inside the Gate: refusals not counted
        app.include_router(create_openai_router(lambda: self.engine))
        app.add_api_route("/admin/profile", self.record_profile, methods=["POST"])

    async def record_profile(
        self, seconds: Annotated[float, Query(gt=0, le=MAX_SECONDS, description="the window")] = 5.0
    ) -> dict[str, Any]:
        """Where a generated request's time goes over the next `seconds` (serve/profile.py): queue,
        tokenize, prefill, joins, decode, sample, host and other, for the mean request submitted and
        answered meanwhile. 409 while a window is open already."""
        self.ready()
        try:
            return await self.engine.profile.record(seconds)
        except RuntimeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None

    async def load(self) -> None:
        await self.loading.run(self._load)

    async def _load(self) -> None:
        o = self.options
        if o.quantize:
            raise GpuforgeError("--quantize: this release quantizes classifiers only")
        engine = await asyncio.to_thread(
            load_engine, self.model_dir, o.device, o.precision, o.max_batch, o.max_queue
        )
        freeze_garbage()
        engine.start()
        self.engine = engine

    async def stop(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)  # finishes the generations under way

    def ready(self) -> None:
        if self.engine is None:
            raise self.loading.unavailable()

    async def predict(self, body: PredictRequest, request: Request) -> Response:
        self.ready()
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, "a causal-lm: POST /v1/completions or /v1/chat/completions"
        )

    def info(self) -> Info:
        self.ready()
        engine = self.engine
        return Info(
            model=engine.name, task="causal-lm", labels=[], device=str(engine.device),
            precision=engine.precision.name, quantized=self.quantized, max_length=None,
            context_length=engine.context, batching="continuous", max_batch=engine.max_batch,
            max_wait_ms=None, max_queue=engine.max_queue, adapters=[], backend=engine.backend,
        )  # fmt: skip

    def update_metrics(self) -> None:
        engine = self.engine
        if engine is not None:  # generated tokens, counted by the engine
            self.metrics.tokens.inc(engine.tokens - self.tokens_counted)
            self.tokens_counted = engine.tokens
            self.metrics.queued.set(engine.queued)


class CountedCompletions:
    """/v1/completions and /v1/chat/completions in /metrics as /predict is: in flight, latency (a stream's
    until its last byte), inputs answered, refusals. Around the routes rather than in them, so that a
    streamed answer is timed to its end without the routes knowing about metrics."""

    def __init__(self, app, metrics: ServeMetrics):
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
