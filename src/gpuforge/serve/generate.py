"""Text generation for causal LMs: a KV cache and continuous batching, in one model thread.

    engine = load_engine("runs/x/model", device="auto", precision="auto", max_batch=16, max_queue=64)
    engine.start()
    async for event in engine.generate("def add(a, b):", SamplingParams(max_tokens=64, stop=["\\n\\n"])):
        print(event.text, end="")            # the last event has finish_reason "stop" | "length"
    engine.stop()                            # finishes what runs and waits, then the thread ends

The engine composes three parts (serve/generation/), as vLLM splits scheduler, executor and output
processor: the scheduler (`scheduler.py`: the waiting queue, its limits, who joins the running batch),
the model step (`model_step.py`: the batched forward over the KV cache, prefill and merge, leaving) and
output processing (`output.py`: sampling, stop conditions, detokenising, the events to the caller).

The model thread loops: each iteration admits the waiting requests (as many as fit beside the running
ones, up to `max_batch`; a burst that is still arriving gets a fraction of a decode step to join), prefills
them together, samples their first tokens and merges the ones that go on into the running batch, runs one
decode step for every active sequence in one batched forward, and lets finished ones leave (max_tokens or
the model's context reached, EOS, a stop string, a caller that went away). A request submitted with
`stream=False` is decoded to text once, as it ends, and hears one event.

`submit()` refuses at once: ValueError for a bad prompt (PromptTooLong for one past the context) and
QueueFull (serve/batcher.py) past `max_queue` waiting requests. Events cross from the model thread to
the caller's event loop with loop.call_soon_threadsafe; a caller that stops iterating (or calls
`cancel()`) frees its place at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gpuforge.runtime.precision import Precision, autocast
from gpuforge.serve.generation.model_step import ModelStep, context_length
from gpuforge.serve.generation.output import (
    DETOKENIZE_CONTEXT,
    Generation,
    OutputProcessor,
    eos_ids,
    sample,
    sampler_for,
    send,
)
from gpuforge.serve.generation.output import held as _held
from gpuforge.serve.generation.request import (
    EngineStopped,
    GenerationEvent,
    PromptTooLong,
    SamplingParams,
    SequenceState,
    profiled,
)
from gpuforge.serve.generation.scheduler import GenerationScheduler
from gpuforge.serve.profile import GenerateProfile

__all__ = [
    "DETOKENIZE_CONTEXT",
    "EngineStopped",
    "Generation",
    "GenerationEngine",
    "GenerationEvent",
    "PromptTooLong",
    "SamplingParams",
    "_held",
    "load_engine",
]

log = logging.getLogger("gpuforge.serve")

LINGER_STEPS = 0.25  # how long a burst of arrivals may hold the next step, in decode steps


class GenerationEngine:
    """Continuous batching over one causal LM (a transformers model, or PEFT on one)."""

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer: Any,
        device: torch.device | str = "cpu",
        precision: Precision | None = None,
        max_batch: int = 16,
        max_queue: int = 64,
        max_context: int | None = None,
        name: str = "model",
    ):
        self.scheduler = GenerationScheduler(max_batch, max_queue)
        self.context = max_context or context_length(module.config)
        self.module, self.tokenizer, self.device = module, tokenizer, torch.device(device)
        self.precision = precision or Precision("fp32", "default")
        self.max_batch, self.max_queue, self.name = max_batch, max_queue, name
        self.output = OutputProcessor(tokenizer, eos_ids(tokenizer, module), self._finished)
        first_eos = next(iter(self.output.eos_ids), 0)
        pad_id = first_eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.model = ModelStep(module, self.device, pad_id)
        self._thread: threading.Thread | None = None
        self.backend = "torch"  # what runs the model: torch, or onnxruntime (an ONNX export)
        self.steps = 0  # decode steps run
        self.profile = GenerateProfile()  # POST /admin/profile's windows (serve/profile.py)
        self._last_step = (0.0, 0.0, 0.0)  # the last decode step's forward, sampling and host seconds
        self.step_s = 0.0  # a running estimate of one decode step's seconds (how long a burst may linger)
        self._answered: list[SequenceState] = []  # profiled sequences ended in this pass (model thread)

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def active(self) -> int:
        return len(self.model.running)

    @property
    def tokens(self) -> int:
        """Tokens generated."""
        return self.output.tokens

    @property
    def eos_ids(self) -> set[int]:
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.output.eos_ids = ids

    @property
    def pad_id(self) -> int:
        return self.model.pad_id

    # -- the caller's side (event loop) --------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.output.encode(text, add_special_tokens)

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, stream: bool = True
    ) -> Generation:
        """Queue one request (from inside a running event loop); QueueFull past max_queue waiting. With
        `stream=False` its text comes whole in the last event (decoded once, not token by token)."""
        params = params or SamplingParams()
        began = time.perf_counter()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        tokenize_s = time.perf_counter() - began
        self.scheduler.check_prompt(ids, self.context, getattr(self.module.config, "vocab_size", None))
        if self._thread is None:
            raise RuntimeError("the engine is not started (call start())")
        self.scheduler.check_room(self.active)
        seq = SequenceState(
            ids,
            len(ids),
            params,
            min(params.max_tokens, self.context - len(ids)),
            asyncio.get_running_loop(),
            asyncio.Queue(),
            sampler_for(params),
            prefix_offset=max(0, len(ids) - DETOKENIZE_CONTEXT),
            read_offset=len(ids),
            started=began,
            stream=stream,
        )
        window = self.profile.open_window()
        if window is not None:
            seq.spent, seq.window = {"tokenize": tokenize_s}, window
        self.scheduler.enqueue(seq)
        return Generation(seq, self.scheduler.cancel)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[GenerationEvent]:
        """Text deltas, then a final event with finish_reason. Closing it early (aclose(), or being
        garbage-collected unfinished) cancels the request."""
        generation = self.submit(prompt, params)
        try:
            async for event in generation:
                yield event
        finally:
            generation.cancel()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is started already")
        self.scheduler.start()
        self._thread = threading.Thread(target=self._run, name="gpuforge-generate", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new requests; finish the running and waiting ones (or, drain=False, end them with
        EngineStopped), then end the model thread. Blocks: from a coroutine, await asyncio.to_thread."""
        self.scheduler.stop(drain, self.model.running)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def warm_up(self) -> None:
        """A prefill and a decode step on a made-up prompt (call before start())."""
        with torch.inference_mode(), autocast(self.precision, self.device):
            self.model.warm_up()

    # -- the model thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(torch.get_num_threads()))
        while (admitted := self.scheduler.next_batch(self.active, LINGER_STEPS * self.step_s)) is not None:
            try:
                with torch.inference_mode(), autocast(self.precision, self.device):
                    if admitted:
                        self._timed_prefill(admitted)
                    self.model.leave([s.cancelled for s in self.model.running])
                    if self.model.running:
                        self._timed_decode_step()
                self._report_answered()
            except Exception as err:  # every request in the batch hears why; the engine goes on
                log.exception("generation step failed")
                for seq in {id(s): s for s in [*self.model.running, *admitted]}.values():
                    send(seq, err)
                self.model.clear()
                self._answered = []

    def _prefill(self, admitted: list[SequenceState]) -> None:
        """Prefill the newcomers, take their first tokens, and merge the ones that go on."""
        prefilled = self.model.prefill(admitted)
        tokens = sample(prefilled.logits, admitted)
        going = [not self.output.advance(seq, token) for seq, token in zip(admitted, tokens, strict=True)]
        self.model.join(prefilled, admitted, going)

    def _decode_step(self, synchronize: bool = False) -> None:
        running = self.model.running
        began = time.perf_counter()
        logits = self.model.decode(synchronize)
        forwarded = time.perf_counter()
        tokens = sample(logits, running)  # the host sync: a GPU's forward ends here
        sampled = time.perf_counter()
        self.steps += 1
        finished = [self.output.advance(seq, token) for seq, token in zip(running, tokens, strict=True)]
        self.model.feed(tokens)
        self.model.leave(finished)
        self._last_step = (forwarded - began, sampled - forwarded, time.perf_counter() - sampled)
        took = time.perf_counter() - began
        self.step_s = took if self.steps == 1 else 0.9 * self.step_s + 0.1 * took

    def _finished(self, seq: SequenceState) -> None:
        """A sequence ended (output processing calls this before its last event is sent)."""
        self.scheduler.finished(time.perf_counter() - seq.started)
        if seq.spent is not None:
            seq.ended = time.perf_counter()
            self._answered.append(seq)  # reported once this pass's times are added

    # a profile window's accounts: three clock reads a step, and a look at each sequence for a profiled one;
    # only with one in the step, the accounts (and, on a GPU, a synchronise: its forward is its own)
    def _timed_prefill(self, admitted: list[SequenceState]) -> None:
        if not profiled(admitted) and not profiled(self.model.running):
            return self._prefill(admitted)
        began, running = time.perf_counter(), list(self.model.running)  # join extends the list itself
        self._prefill(admitted)
        took = time.perf_counter() - began
        for seq in admitted:
            if seq.spent is not None:
                seq.spent["queue"] = began - seq.started - seq.spent["tokenize"]
                seq.spent["prefill"] = took
        for seq in running:  # the running batch waited for the newcomers' prefill
            if seq.spent is not None:
                seq.spent["joins"] = seq.spent.get("joins", 0.0) + took

    def _timed_decode_step(self) -> None:
        stepping = self.model.running
        self._decode_step(synchronize=profiled(stepping) and self.device.type == "cuda")
        self.profile.step(len(stepping))
        if not profiled(stepping):
            return
        forward_s, sample_s, host_s = self._last_step
        for seq in stepping:
            if seq.spent is not None:
                for name, seconds in (("decode", forward_s), ("sample", sample_s), ("host", host_s)):
                    seq.spent[name] = seq.spent.get(name, 0.0) + seconds

    def _report_answered(self) -> None:
        if not self._answered:
            return
        for seq in self._answered:
            self.profile.answered(seq.window, seq.spent, seq.ended - seq.started, seq.generated)
        self._answered = []


def cpu_threads(available: int) -> int:
    """The model thread's intra-op threads on a CPU: one fewer than the process has, leaving a core to the
    event loop (HTTP, tokenizing). With every core in the forward's parallel regions, any other thread
    that runs (the event loop, a load generator, a neighbour) stalls each region's barrier: a tiny model's
    step then takes several times as long."""
    return max(1, available - 1)


def load_engine(
    model_dir: str | Path,
    device: str = "auto",
    precision: str = "auto",
    max_batch: int = 16,
    max_queue: int = 64,
) -> GenerationEngine:
    """A GenerationEngine on a run's model/ directory (a causal-lm), warmed up and not yet started."""
    from gpuforge.artifact import load_artifact
    from gpuforge.errors import GpuforgeError
    from gpuforge.hardware.probe import select_device
    from gpuforge.runtime.device_share import cap_cuda_memory
    from gpuforge.runtime.precision import choose_precision

    torch_device = select_device(device)
    cap_cuda_memory(torch_device)  # a fraction of a GPU: held to its share of the memory
    module, tokenizer, manifest = load_artifact(model_dir, torch_device)
    if manifest.task != "causal-lm" or tokenizer is None:
        raise GpuforgeError(f"{model_dir}: a {manifest.task} model; generation needs a causal-lm")
    if manifest.format == "onnx":  # onnxruntime runs the graph as exported (fp32, or its int8 layers)
        if getattr(module, "cache", None) is None:
            why = manifest.onnx.no_cache if manifest.onnx else None
            raise GpuforgeError(
                f"{model_dir}: an ONNX export of the logits alone, without the key/value cache to generate "
                f"with{f' ({why})' if why else ''}: serve the model directory it came from"
            )
        torch_device, precision = module.device, "fp32"
    chosen = choose_precision(precision, torch_device)
    engine = GenerationEngine(
        module, tokenizer, torch_device, chosen, max_batch, max_queue, name=manifest.job or "model"
    )
    engine.backend = f"onnxruntime ({module.provider})" if manifest.format == "onnx" else "torch"
    engine.warm_up()
    log.info("generating with %s on %s, precision %s", model_dir, torch_device, chosen.name)
    return engine
