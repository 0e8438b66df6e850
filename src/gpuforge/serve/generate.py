"""Text generation for causal LMs: a KV cache and continuous batching, in one model thread.

    engine = load_engine("runs/x/model", device="auto", precision="auto", max_batch=16, max_queue=64)
    engine.start()
    async for event in engine.generate("def add(a, b):", SamplingParams(max_tokens=64, stop=["\\n\\n"])):
        print(event.text, end="")            # the last event has finish_reason "stop" | "length"
    engine.stop()                            # finishes what runs and waits, then the thread ends

The model thread loops: each iteration admits waiting requests (while fewer than `max_batch` run),
prefills them together (left-padded), merges their KV caches into the running batch, runs one decode
step for every active sequence in one batched forward, and lets finished ones leave (max_tokens or the
model's context reached, EOS, a stop string, a caller that went away). Sequences of different lengths
share the batch through left padding: an attention mask hides the padding and explicit position_ids give
each sequence its own positions. Merging pads both caches on the left to a common length and
concatenates them on the batch axis; leaving index-selects the others and drops padding columns that no
remaining sequence needs.

`submit()` refuses at once: ValueError for a bad prompt (PromptTooLong for one past the context) and
QueueFull (serve/batcher.py) past `max_queue` waiting requests. Events cross from the model thread to
the caller's event loop with loop.call_soon_threadsafe; a caller that stops iterating (or calls
`cancel()`) frees its place at the next step.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuforge.runtime.kv_cache import cache_argument, cache_layers, returned_cache, with_layers
from gpuforge.runtime.precision import Precision, autocast
from gpuforge.serve.batcher import QueueFull
from gpuforge.serve.profile import GenerateProfile

log = logging.getLogger("gpuforge.serve")
DETOKENIZE_CONTEXT = 5  # prompt tokens decoded with the first generated ones (leading spaces, merges)


class PromptTooLong(ValueError):
    """A prompt that leaves no room in the model's context for one generated token."""

    def __init__(self, tokens: int, context: int):
        super().__init__(
            f"the prompt is {tokens} tokens; the model's context is {context} tokens, "
            "and at least one must remain for the answer"
        )
        self.tokens, self.context = tokens, context


class EngineStopped(RuntimeError):
    """The engine stopped (without draining) before this request finished."""


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy; `seed` makes sampling repeatable."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()  # text; the answer ends before the first one found, which is left out
    seed: int | None = None
    ignore_eos: bool = False  # go on past EOS (benchmarks)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")


@dataclass(frozen=True)
class GenerationEvent:
    """New text; the last event of a request has finish_reason ("stop" | "length") and the counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: tuple[int, ...] = ()  # on the last event: every generated token (EOS included)


@dataclass(eq=False)  # compared by identity (the waiting queue removes exactly this one)
class _Sequence:
    """One request, as the model thread sees it."""

    ids: list[int]  # prompt + generated (EOS left out)
    prompt_len: int
    params: SamplingParams
    cap: int  # tokens it may generate: max_tokens, or fewer where the context ends first
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generator: torch.Generator | None
    cancelled: bool = False
    generated: int = 0
    text: str = ""  # generated text so far (part of it may be held back: a stop string may begin there)
    emitted: int = 0  # characters of `text` sent
    prefix_offset: int = 0  # incremental detokenizing (as text-generation-inference does it)
    read_offset: int = 0
    started: float = field(default_factory=time.perf_counter)
    spent: dict[str, float] | None = None  # submitted while a profile window records: its time, by part
    window: Any = None  # that window (serve/profile.py): the request counts in it alone
    ended: float = 0.0  # when its last event was sent


class Generation:
    """One submitted request: an async iterator of GenerationEvents; `cancel()` frees its place."""

    def __init__(self, engine: GenerationEngine, seq: _Sequence):
        self._engine, self._seq, self._done = engine, seq, False

    @property
    def prompt_tokens(self) -> int:
        return self._seq.prompt_len

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._seq.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    async def collect(self) -> GenerationEvent:
        """The whole answer as one event: all the text, the finish reason and the counts."""
        parts = []
        try:
            async for event in self:
                parts.append(event.text)
                if event.finish_reason is not None:
                    return GenerationEvent(
                        "".join(parts),
                        event.finish_reason,
                        event.prompt_tokens,
                        event.completion_tokens,
                        event.token_ids,
                    )
        finally:
            self.cancel()
        raise RuntimeError("generation ended without a final event")

    def cancel(self) -> None:
        """Stop generating (no-op once finished); a waiting request leaves the queue at once."""
        if not self._done:
            self._done = True
            self._engine._cancel(self._seq)

    def __del__(self):
        self._seq.cancelled = True  # dropped unread: the model thread lets it go at its next step


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
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.module, self.tokenizer, self.device = module, tokenizer, torch.device(device)
        self.precision = precision or Precision("fp32", "default")
        self.max_batch, self.max_queue, self.name = max_batch, max_queue, name
        config = module.config
        self.context = max_context or _context_length(config)
        self.eos_ids = _eos_ids(tokenizer, module)
        self.pad_id = (
            next(iter(self.eos_ids), 0) if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        )
        forward = inspect.signature(getattr(module, "get_base_model", lambda: module)().forward).parameters
        self._cache_arg = cache_argument(module)
        self._keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._waiting: deque[_Sequence] = deque()
        self._cond = threading.Condition()
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe to share between threads
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seconds_per_request = 1.0  # a running estimate, for Retry-After
        # The running batch (model thread only): sequences, their KV cache [B, heads, T, dim] per layer,
        # attention mask [B, T], next position [B] and next input token [B].
        self._active: list[_Sequence] = []
        self._cache: Any = None
        self._mask = self._positions = self._next = None
        self.backend = "torch"  # what runs the model: torch, or onnxruntime (an ONNX export)
        self.steps = 0  # decode steps run
        self.tokens = 0  # tokens generated
        self.profile = GenerateProfile()  # POST /admin/profile's windows (serve/profile.py)
        self._last_step = (0.0, 0.0, 0.0)  # the last decode step's forward, sampling and host seconds
        self._answered: list[_Sequence] = []  # profiled sequences ended in this pass (model thread)

    # -- the caller's side (event loop) --------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Generation:
        """Queue one request (from inside a running event loop); QueueFull past max_queue waiting."""
        params = params or SamplingParams()
        began = time.perf_counter()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        tokenize_s = time.perf_counter() - began
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = getattr(self.module.config, "vocab_size", None)
        if vocab and not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.context:
            raise PromptTooLong(len(ids), self.context)
        if self._thread is None:
            raise RuntimeError("the engine is not started (call start())")
        if self._stopping:
            raise QueueFull(1.0)
        if len(self._waiting) >= self.max_queue:
            waves = (len(self._waiting) + self.active) / self.max_batch
            raise QueueFull(max(1.0, waves * self._seconds_per_request))
        generator = None
        if params.temperature > 0:
            generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else random.getrandbits(63)
            )
        start = max(0, len(ids) - DETOKENIZE_CONTEXT)
        seq = _Sequence(
            ids,
            len(ids),
            params,
            min(params.max_tokens, self.context - len(ids)),
            asyncio.get_running_loop(),
            asyncio.Queue(),
            generator,
            prefix_offset=start,
            read_offset=len(ids),
            started=began,
        )
        window = self.profile.open_window()
        if window is not None:
            seq.spent, seq.window = {"tokenize": tokenize_s}, window
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify()
        return Generation(self, seq)

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

    def _cancel(self, seq: _Sequence) -> None:
        seq.cancelled = True
        with self._cond:
            if seq in self._waiting:
                self._waiting.remove(seq)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is started already")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gpuforge-generate", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new requests; finish the running and waiting ones (or, drain=False, end them with
        EngineStopped), then end the model thread. Blocks: from a coroutine, await asyncio.to_thread."""
        with self._cond:
            self._stopping = True
            if not drain:
                for seq in [*self._waiting, *self._active]:
                    _send(seq, EngineStopped("the engine stopped"))
                    seq.cancelled = True
                self._waiting.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def warm_up(self) -> None:
        """A prefill and a decode step on a made-up prompt (call before start())."""
        with torch.inference_mode(), autocast(self.precision, self.device):
            ids = torch.full((1, 8), self.pad_id, device=self.device)
            out = self._forward(ids, torch.ones_like(ids), torch.arange(8, device=self.device)[None], None)
            mask = torch.ones(1, 9, dtype=torch.long, device=self.device)
            self._forward(ids[:, :1], mask, torch.tensor([[8]], device=self.device), returned_cache(out))

    # -- the model thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._waiting and not self._active:
                    return
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                    seq = self._waiting.popleft()
                    if not seq.cancelled:
                        admitted.append(seq)
            try:
                with torch.inference_mode(), autocast(self.precision, self.device):
                    if admitted:
                        self._timed_prefill(admitted)
                    self._leave([s.cancelled for s in self._active])
                    if self._active:
                        self._timed_decode_step()
                self._report_answered()
            except Exception as err:  # every request in the batch hears why; the engine goes on
                log.exception("generation step failed")
                for seq in {id(s): s for s in [*self._active, *admitted]}.values():
                    _send(seq, err)
                self._active, self._cache, self._answered = [], None, []
                self._mask = self._positions = self._next = None

    # a profile window's accounts: three clock reads a step, and a look at each sequence for a profiled one;
    # only with one in the step, the accounts (and, on a GPU, a synchronise: its forward is its own)
    def _timed_prefill(self, admitted: list[_Sequence]) -> None:
        if not _profiled(admitted) and not _profiled(self._active):
            return self._prefill(admitted)
        began, running = time.perf_counter(), list(self._active)  # _prefill extends the list itself
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
        stepping = self._active
        self._decode_step(synchronize=_profiled(stepping) and self.device.type == "cuda")
        self.profile.step(len(stepping))
        if not _profiled(stepping):
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

    def _forward(self, ids, mask, positions, cache):
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        return self.module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self._keep_logits,
            **kwargs,
        )

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Run the new prompts together (left-padded), sample their first tokens, and merge the ones
        that go on into the running batch."""
        length = max(len(s.ids) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, length - len(seq.ids) :] = torch.tensor(seq.ids)
            mask[i, length - len(seq.ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(ids, mask, positions, None)
        kv = cache_layers(returned_cache(out))
        hidden = (mask == 0)[:, None, :, None]
        kv = [(k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)) for k, v in kv]  # padding stays finite
        tokens = self._sample(out.logits[:, -1, :], seqs)
        going = [not self._advance(seq, token) for seq, token in zip(seqs, tokens, strict=True)]
        if not any(going):
            return
        keep = torch.tensor([i for i, g in enumerate(going) if g], device=self.device)
        kv = [(k[keep], v[keep]) for k, v in kv]
        mask, positions = mask[keep], positions[keep, -1] + 1
        joining = [s for s, g in zip(seqs, going, strict=True) if g]
        next_ids = torch.tensor([s.ids[-1] for s in joining], device=self.device)
        if not self._active:
            self._cache = with_layers(returned_cache(out), kv)
            self._mask, self._positions, self._next = mask, positions, next_ids
        else:  # pad both on the left to one length, then one batch
            width = max(self._mask.shape[1], mask.shape[1])
            old = [(_pad_left(k, width), _pad_left(v, width)) for k, v in cache_layers(self._cache)]
            new = [(_pad_left(k, width), _pad_left(v, width)) for k, v in kv]
            merged = [(torch.cat([a, c]), torch.cat([b, d])) for (a, b), (c, d) in zip(old, new, strict=True)]
            self._cache = with_layers(self._cache, merged)
            self._mask = torch.cat([_pad_left(self._mask, width, dim=1), _pad_left(mask, width, dim=1)])
            self._positions = torch.cat([self._positions, positions])
            self._next = torch.cat([self._next, next_ids])
        self._active.extend(joining)

    def _decode_step(self, synchronize: bool = False) -> None:
        batch = len(self._active)
        began = time.perf_counter()
        self._mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
        out = self._forward(self._next[:, None], self._mask, self._positions[:, None], self._cache)
        self._cache = returned_cache(out)
        self._positions = self._positions + 1
        if synchronize:
            torch.cuda.synchronize(self.device)  # a profiled step: the forward's time, not its launch's
        forwarded = time.perf_counter()
        tokens = self._sample(out.logits[:, -1, :], self._active)  # the host sync: a GPU's forward ends here
        sampled = time.perf_counter()
        self.steps += 1
        finished = [self._advance(seq, token) for seq, token in zip(self._active, tokens, strict=True)]
        self._next = torch.tensor(tokens, device=self.device)
        self._leave(finished)
        self._last_step = (forwarded - began, sampled - forwarded, time.perf_counter() - sampled)

    def _leave(self, gone: list[bool]) -> None:
        """Drop the sequences marked gone from the batch, and the padding columns nobody needs."""
        if not any(gone):
            return
        keep = [i for i, g in enumerate(gone) if not g]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._positions = self._next = None
            return
        index = torch.tensor(keep, device=self._mask.device)
        mask = self._mask[index]
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0  # columns before it are padding in every row left
        self._mask = mask[:, first:]
        self._cache = with_layers(
            self._cache, [(k[index, :, first:], v[index, :, first:]) for k, v in cache_layers(self._cache)]
        )
        self._positions, self._next = self._positions[index], self._next[index]

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        """One token a sequence: argmax where temperature is 0, else top-p sampling on the CPU with the
        request's own generator."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        if sampled:
            rows = logits[torch.tensor(sampled, device=logits.device)].cpu()
            for row, i in zip(rows, sampled, strict=True):
                tokens[i] = _top_p_sample(row, seqs[i].params, seqs[i].generator)
        return tokens

    def _advance(self, seq: _Sequence, token: int) -> bool:
        """Take one generated token: emit the text that is safe to send; True when the sequence ends."""
        seq.generated += 1
        self.tokens += 1
        eos = token in self.eos_ids and not seq.params.ignore_eos
        if not eos:
            seq.ids.append(token)
        reason = "stop" if eos else ("length" if seq.generated >= seq.cap else None)
        seq.text += self._detokenize(seq, flush=reason is not None)
        stops = seq.params.stop
        if stops:
            found = [p for p in (seq.text.find(s, seq.emitted) for s in stops) if p >= 0]
            if found:
                seq.text, reason = seq.text[: min(found)], "stop"
        if reason is not None:
            self._seconds_per_request = 0.8 * self._seconds_per_request + 0.2 * (
                time.perf_counter() - seq.started
            )
            if seq.spent is not None:
                seq.ended = time.perf_counter()
                self._answered.append(seq)  # reported once this pass's times are added
            out = (*seq.ids[seq.prompt_len :], *([token] if eos else []))
            _send(seq, GenerationEvent(seq.text[seq.emitted :], reason, seq.prompt_len, seq.generated, out))
            return True
        safe = len(seq.text) - _held(seq.text, stops)
        if safe > seq.emitted:
            _send(seq, GenerationEvent(seq.text[seq.emitted : safe]))
            seq.emitted = safe
        return seq.cancelled

    def _detokenize(self, seq: _Sequence, flush: bool = False) -> str:
        """The text the newest tokens add; held back while it ends inside a multi-byte character (never sent
        as U+FFFD: at the end, bytes that make no whole character are left out)."""
        with self._tokenizer_lock:
            before = self.tokenizer.decode(
                seq.ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True
            )
            after = self.tokenizer.decode(seq.ids[seq.prefix_offset :], skip_special_tokens=True)
        held = after[len(before) :]
        if flush and held.endswith("\ufffd") and not held[:-1].endswith("\ufffd"):
            # the answer ends inside a character: no token will complete its first bytes, so none is sent
            # (a run of them is bytes that are no UTF-8 at all: shown, as decode() shows them)
            after = after[:-1]
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.ids)
            return after[len(before) :]
        return ""


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
    from gpuforge.runtime.precision import choose_precision

    torch_device = select_device(device)
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


def _profiled(seqs: list[_Sequence]) -> bool:
    return any(seq.spent is not None for seq in seqs)


def _send(seq: _Sequence, item: GenerationEvent | BaseException) -> None:
    try:
        seq.loop.call_soon_threadsafe(seq.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed: nobody listens
        seq.cancelled = True


def _held(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that may be the start of a stop string: not sent yet."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def _top_p_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # the first always stays
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _context_length(config: Any) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model's config names no context length; pass max_context")


def _eos_ids(tokenizer: Any, module: torch.nn.Module) -> set[int]:
    ids = set()
    generation = getattr(module, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _pad_left(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
