"""A classifier behind POST /predict: a Predictor (serve/predict.py) whose inputs, from every request,
share batches (serve/batcher.py).

A request is taken whole or refused whole: past the queue's room, 429 with Retry-After; past `timeout_s`,
504; a client that goes away frees its place (its inputs are dropped before they reach the model).

With --adapters-root, LoRA adapters come and go while the worker runs (no restart, no reload of the base):

    POST   /admin/adapters {"name": "topics", "path": "runs/7/model"}  201 {"adapters": [...]}; 200 if there
           already; 403 a path outside the root; 409 a name taken, or a full model served; 422 another base
    DELETE /admin/adapters/topics                                      200 {"adapters": [...]}; 404 unknown;
           409 "default" (the served model's own)

    POST   /admin/profile?seconds=5    where a served input's time went over those seconds (serve/profile.py)
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse, Response

from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.policy import Policy
from gpuforge.serve.adapters import OWN, AdapterConflict, Adapters, check_adapters
from gpuforge.serve.batcher import Batcher, BatchStats, QueueFull
from gpuforge.serve.endpoint import (
    AdapterAdd,
    AdapterList,
    Info,
    LoadState,
    PredictRequest,
    client_gone,
    freeze_garbage,
)
from gpuforge.serve.generator_backend import COMPLETION_PATHS
from gpuforge.serve.metrics import ServeMetrics
from gpuforge.serve.openai_api import error_response
from gpuforge.serve.options import ServeOptions
from gpuforge.serve.predict import InputError, Predictor, load_predictor
from gpuforge.serve.profile import MAX_SECONDS, ServeProfile

MAX_INPUTS = 256  # per request (and never more than the queue holds)
Item = tuple[str | None, Any]  # (adapter name or None, a checked input)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ClassifierBackend:
    """Labels and scores for inputs, in dynamic batches (those within max_wait_ms share one)."""

    def __init__(
        self, model_dir: Path, options: ServeOptions, metrics: ServeMetrics, adapters: dict[str, Path]
    ):
        self.model_dir, self.options, self.metrics, self.adapters = model_dir, options, metrics, adapters
        self.loading = LoadState(model_dir)
        self.predictor: Predictor | None = None
        self.batcher: Batcher | None = None  # set last: the model answers once it is
        self.profile = ServeProfile()

    def install(self, app: FastAPI) -> None:
        # /predict is the worker's own route; these are sync, so they run in a thread: a model thread
        # loading an adapter holds the Adapters' lock for a while, and the event loop must not wait on it
        app.add_api_route("/admin/adapters", self.add_adapter, methods=["POST"], status_code=201,
                          response_model=AdapterList, responses={200: {"model": AdapterList}})  # fmt: skip
        app.add_api_route(
            "/admin/adapters/{name}", self.remove_adapter, methods=["DELETE"], response_model=AdapterList
        )
        app.add_api_route("/admin/profile", self.record_profile, methods=["POST"])
        for path in sorted(COMPLETION_PATHS):  # a client that took this for a causal LM: told what it is
            app.add_api_route(path, self.no_completions, methods=["POST"], include_in_schema=False)

    def no_completions(self) -> JSONResponse:
        """404 on the completion routes, in the shape OpenAI clients read, saying what to call instead."""
        task = self.predictor.task if self.predictor is not None else "a classification task"
        return error_response(
            status.HTTP_404_NOT_FOUND,
            f"this model is a classifier ({task}), not a causal LM: it completes no text; POST /predict "
            '{"inputs": ["some text"]} for its labels',
        )

    async def record_profile(
        self, seconds: Annotated[float, Query(gt=0, le=MAX_SECONDS, description="the window")] = 5.0
    ) -> dict[str, Any]:
        """Where a served input's time goes over the next `seconds` (serve/profile.py): queue, tokenize,
        forward, scores, respond and other, for the mean input answered meanwhile. 409 while a window is
        open already."""
        self.ready()
        try:
            return await self.profile.record(seconds)
        except RuntimeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None

    def add_adapter(self, body: AdapterAdd) -> Response:
        """Serve one more LoRA adapter on the served base, from a model/ directory under --adapters-root;
        it loads on first use. 201, or 200 when it is served from that path already."""
        adapters = self._adapter_admin()
        if adapters is None:
            raise HTTPException(
                status.HTTP_409_CONFLICT, "a full model is served; adapters need an adapter's base"
            )
        root = Path(self.options.adapters_root)
        path = (root / body.path).resolve()
        try:  # where it, and each file in it, really is (links followed) must be under the root
            Policy(roots=(root,)).check_path("path", path)
        except SpecError as err:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, f"path: {body.path} is outside --adapters-root ({err})"
            ) from None
        try:
            added = not adapters.registered(body.name, path)
            if added:
                manifest = check_adapters(self.model_dir, {body.name: path})[body.name]
                added = adapters.add(body.name, path, manifest)  # False: a request just like this was first
        except AdapterConflict as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None
        return JSONResponse({"adapters": adapters.names()}, 201 if added else 200)

    def remove_adapter(self, name: str) -> AdapterList:
        """Stop serving an adapter: requests naming it are refused from now on, as an unknown one's."""
        adapters = self._adapter_admin()
        if adapters is not None and name == OWN:
            raise HTTPException(status.HTTP_409_CONFLICT, f"adapter: {OWN!r} is the served model's own")
        if adapters is None or not adapters.known(name):
            raise HTTPException(status.HTTP_404_NOT_FOUND, self._unknown(name))
        adapters.remove(name)  # its weights go in the model thread, between batches
        return AdapterList(adapters=adapters.names())

    def _adapter_admin(self) -> Adapters | None:
        """The served model's adapters (None: a full model); 404 without --adapters-root, 503 before the
        model is ready."""
        if self.options.adapters_root is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, "adapter admin is off (--adapters-root)")
        self.ready()
        return self.predictor.adapters

    def _unknown(self, name: str) -> str:
        adapters = self.predictor.adapters
        return adapters.unknown(name) if adapters else f"adapter: unknown adapter {name!r} (served: none)"

    async def load(self) -> None:
        await self.loading.run(self._load)

    async def _load(self) -> None:
        o = self.options
        predictor = await asyncio.to_thread(
            load_predictor, self.model_dir, o.device, o.precision, o.quantize, o.max_length, self.adapters,
            o.max_adapters, o.eval_at_load, o.max_batch,
        )  # fmt: skip
        await asyncio.to_thread(predictor.warm_up, (1, min(8, o.max_batch), o.max_batch))
        freeze_garbage()
        batcher = Batcher(
            functools.partial(self._run_batch, predictor), o.max_batch, o.max_wait_ms, o.max_queue,
            self._batch_done,
        )  # fmt: skip
        await batcher.start()
        self.predictor, self.batcher = predictor, batcher

    def _run_batch(self, predictor: Predictor, items: list[Item]) -> list[dict[str, Any]]:
        before = predictor.tokens_read
        predictor.last_split = None
        results = predictor.run_batch(items)
        self.metrics.inputs.inc(len(items))
        self.metrics.tokens.inc(predictor.tokens_read - before)  # counted by the tokenizer, not guessed
        if predictor.last_split is not None:
            self.profile.batch_split(*predictor.last_split)
        return results

    def _batch_done(self, stats: BatchStats) -> None:
        self.metrics.batch_done(stats)
        self.profile.batch_done(stats.size, stats.queue_seconds, stats.run_seconds)

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()  # answers what is queued before the process exits

    def ready(self) -> None:
        if self.batcher is None:
            raise self.loading.unavailable()

    async def predict(self, body: PredictRequest, request: Request) -> Response:
        started = time.perf_counter()
        self.ready()
        items = self._items(body)
        self.metrics.in_flight.inc()
        try:
            self.batcher.room_for(len(items))  # all of them, or none: a 429 runs nothing
            outputs = await self._answer(request, items)
        except QueueFull as err:
            self.metrics.rejected.labels("queue full").inc()
            return JSONResponse({"detail": str(err)}, status.HTTP_429_TOO_MANY_REQUESTS,
                                headers={"Retry-After": str(math.ceil(err.retry_after_s))})  # fmt: skip
        except ClientGone:
            return JSONResponse({"detail": "client closed the request"}, 499)  # nobody reads it
        except InputError as err:  # its adapter was removed while it waited
            return JSONResponse({"detail": str(err)}, err.status)
        except TimeoutError:
            self.metrics.rejected.labels("timeout").inc()
            timeout = f"no answer within {self.options.timeout_s:g} s"
            return JSONResponse({"detail": timeout}, status.HTTP_504_GATEWAY_TIMEOUT)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.queued.set(self.batcher.queued)
        self.metrics.latency.observe(time.perf_counter() - started)
        # the outputs are built by our own code in PredictResponse's shape: sent as they are, not validated
        # again (that cost ~10% of a request's CPU time under load)
        encoding = time.perf_counter()
        answer = json.dumps({"model": self.predictor.name, "outputs": outputs}, separators=(",", ":"))
        done = time.perf_counter()
        self.profile.answered(len(items), done - encoding, done - started)
        return Response(answer, media_type="application/json")

    def _items(self, body: PredictRequest) -> list[Item]:
        """The request's inputs, each checked, with the adapter it names; an HTTPException for the first
        thing wrong."""
        predictor = self.predictor
        inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if not inputs:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "inputs: empty; send at least one")
        allowed = min(MAX_INPUTS, self.options.max_queue)
        if len(inputs) > allowed:
            too_many = f"inputs: {len(inputs)} in one request, over the {allowed} allowed"
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, too_many)
        adapter = body.adapter
        if adapter is not None and not (predictor.adapters and predictor.adapters.known(adapter)):
            raise HTTPException(status.HTTP_404_NOT_FOUND, self._unknown(adapter))
        items = []
        for i, raw in enumerate(inputs):
            try:
                items.append((adapter, predictor.check(raw)))
            except InputError as err:
                raise HTTPException(err.status, f"inputs[{i}]: {err}") from None
        return items

    async def _answer(self, request: Request, items: list[Item]) -> list[dict[str, Any]]:
        """The batcher's results for `items`; a client that disconnects first cancels them. The body is
        read, so the next ASGI message is the disconnect: one waiting task per request, no polling."""
        timeout_s = self.options.timeout_s
        if len(items) == 1:
            work = asyncio.ensure_future(self.batcher.submit(items[0], timeout_s))
        else:
            work = asyncio.ensure_future(asyncio.gather(*(self.batcher.submit(i, timeout_s) for i in items)))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            self.metrics.rejected.labels("client gone").inc()
            raise ClientGone
        result = work.result()
        return [result] if len(items) == 1 else result

    def info(self) -> Info:
        self.ready()
        p, o = self.predictor, self.options
        return Info(
            model=p.name, task=p.task, labels=p.labels, device=str(p.device), precision=p.precision.name,
            quantized=p.quantized, backend=p.backend, max_length=p.max_length, batching="dynamic",
            max_batch=o.max_batch,
            max_wait_ms=o.max_wait_ms, max_queue=o.max_queue,
            adapters=p.adapters.names() if p.adapters else [], quantize_report=p.quantize_report,
            eval=p.eval_result, precision_choice=p.plan.describe() if p.plan else None,
        )  # fmt: skip

    def update_metrics(self) -> None:
        if self.batcher is not None:
            self.metrics.queued.set(self.batcher.queued)
