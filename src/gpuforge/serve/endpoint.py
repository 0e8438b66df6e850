"""What a worker's routes (serve/worker.py) call, whichever kind of model it serves: a `Backend`.

    ClassifierBackend   serve/classifier_backend.py: a Predictor (serve/predict.py), dynamic batches
    GeneratorBackend    serve/generator_backend.py: a GenerationEngine (serve/generate.py), OpenAI routes

Also the bodies the worker's own routes take and answer, and `LoadState`, the background load both share.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request, Response, status
from pydantic import BaseModel, ConfigDict, Field

from gpuforge.serve.adapters import NAME_MAX, NAME_PATTERN

log = logging.getLogger("gpuforge.serve")


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


class AdapterAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX, description="what requests call it")
    path: str = Field(description="its model/ directory, under --adapters-root (a relative path: from there)")


class AdapterList(BaseModel):
    adapters: list[str] = Field(description="the adapters served now, the served model's own first")


class EvalMetric(BaseModel):
    metric: str = Field(description="accuracy for a classifier")
    value: float
    examples: int = Field(description="of the run's held-out split, every one measured")


class Info(BaseModel):
    model: str
    task: str
    labels: list[str]
    device: str
    precision: str = Field(description="what full batches run in (precision_choice: which batches, why)")
    precision_choice: dict[str, Any] | None = Field(
        None,
        description="rule: which batch sizes run in which precision; reason; measured_ms: with auto, "
        "each batch size's time in fp32 and in the lower precision on the served model, which chose it",
    )
    quantized: str | None = Field(description="int8, int4 or int8-dynamic (--quantize, gpuforge compress)")
    backend: str = Field("torch", description="what runs the model: torch, or onnxruntime (an ONNX export)")
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
    eval: EvalMetric | None = Field(
        None,
        description="the eval metric as served, after any --quantize (--eval-at-load; null without "
        "it or without a held-out split)",
    )


class Backend(Protocol):
    """One kind of served model as the routes see it. Its model loads in the background (`load`, started
    once the server listens); until it is ready, what needs it answers 503 with the reason."""

    def install(self, app: FastAPI) -> None:
        """Add this kind's own routes and middleware (inside the Gate)."""

    async def load(self) -> None:
        """Load and warm up the model; a failure is kept for /readyz to say (the process stays up)."""

    async def stop(self) -> None:
        """Answer what is held, then let the model go (on SIGTERM)."""

    def ready(self) -> None:
        """Return once the model answers; before, an HTTPException 503 that says why."""

    async def predict(self, body: PredictRequest, request: Request) -> Response:
        """POST /predict's answer (called by serve/predict_route.py, which has read `request`'s body: its
        next message is the disconnect)."""

    def info(self) -> Info:
        """GET /info's answer."""

    def update_metrics(self) -> None:
        """Bring the figures that are read rather than counted up to date, before /metrics answers."""


class LoadState:
    """A model loading in the background: whether it failed, and why."""

    def __init__(self, model_dir: Path):
        self.model_dir, self.error = model_dir, None

    async def run(self, load: Callable[[], Awaitable[None]]) -> None:
        try:
            await load()
        except Exception as err:  # the process stays up to say why on /readyz
            log.exception("loading %s failed", self.model_dir)
            self.error = f"{type(err).__name__}: {err}"
            return
        log.info("ready: %s", self.model_dir)

    def unavailable(self) -> HTTPException:
        """The 503 for a request that needs the model before it is ready."""
        why = self.error or "the model is still loading"
        return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, why, headers={"Retry-After": "5"})


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. For a request whose body is read already, the next ASGI
    message is the disconnect: one waiting task per request, no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def freeze_garbage() -> None:
    """Move what loading made (~440k objects of torch and transformers) out of the collector's sight: a
    full collection over them paused every request for 215-254 ms; with them frozen, 1-9 ms."""
    gc.collect()
    gc.freeze()
