"""Output processing: a token a sequence from the logits (greedy or top-p), the text it adds (held back
inside a multi-byte character or where a stop string may begin), when a sequence ends (EOS, a stop string,
max_tokens or the context), and the events that cross to the caller's event loop.

Runs on the model thread, except `Generation` (the caller's async iterator) and `encode` (the caller's
tokenizing), which share the tokenizer through one lock: a fast tokenizer is not safe to share between
threads.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpuforge.serve.generation.request import GenerationEvent, SamplingParams, SequenceState

DETOKENIZE_CONTEXT = 5  # prompt tokens decoded with the first generated ones (leading spaces, merges)


class Generation:
    """One submitted request: an async iterator of GenerationEvents; `cancel()` frees its place."""

    def __init__(self, seq: SequenceState, cancel: Callable[[SequenceState], None]):
        self._seq, self._cancel, self._done = seq, cancel, False

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
            self._cancel(self._seq)

    def __del__(self):
        self._seq.cancelled = True  # dropped unread: the model thread lets it go at its next step


def send(seq: SequenceState, item: GenerationEvent | BaseException) -> None:
    """Hand an event (or the error that ends the request) to the caller's event loop."""
    try:
        seq.loop.call_soon_threadsafe(seq.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed: nobody listens
        seq.cancelled = True


def sampler_for(params: SamplingParams) -> torch.Generator | None:
    """The request's own random generator (seeded when it asks), or None when it is greedy."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, seqs: list[SequenceState]) -> list[int]:
    """One token a sequence: argmax where temperature is 0, else top-p sampling on the CPU with the
    request's own generator."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if sampled:
        rows = logits[torch.tensor(sampled, device=logits.device)].cpu()
        for row, i in zip(rows, sampled, strict=True):
            tokens[i] = top_p_sample(row, seqs[i].params, seqs[i].generator)
    return tokens


def top_p_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # the first always stays
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def held(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that may be the start of a stop string: not sent yet."""
    kept = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), kept, -1):
            if text.endswith(stop[:k]):
                kept = k
                break
    return kept


def eos_ids(tokenizer: Any, module: torch.nn.Module) -> set[int]:
    """The tokens that end an answer: the tokenizer's and the model's generation config's."""
    ids = set()
    generation = getattr(module, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class OutputProcessor:
    """Takes each generated token into its sequence and streams what is safe to send.

    `on_finish(seq)` runs on the model thread as a sequence ends, before its last event is sent."""

    def __init__(self, tokenizer: Any, eos: set[int], on_finish: Callable[[SequenceState], None]):
        self.tokenizer, self.eos_ids, self._on_finish = tokenizer, eos, on_finish
        self._tokenizer_lock = threading.Lock()
        self.tokens = 0  # tokens generated

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def advance(self, seq: SequenceState, token: int) -> bool:
        """Take one generated token: emit the text that is safe to send; True when the sequence ends
        (or its caller went away). A request that is not streamed is decoded once, as it ends, unless
        it has stop strings: then the newest tokens' text is looked at for them as it comes."""
        seq.generated += 1
        self.tokens += 1
        eos = token in self.eos_ids and not seq.params.ignore_eos
        if not eos:
            seq.ids.append(token)
        reason = "stop" if eos else ("length" if seq.generated >= seq.cap else None)
        stops = seq.params.stop
        if seq.stream or stops or reason is not None:
            searched = len(seq.text)
            seq.text += self.detokenize(seq, flush=reason is not None)
            if stops:  # only where the new text could complete one: the tail
                at = (seq.text.find(s, max(seq.emitted, searched - len(s) + 1)) for s in stops)
                found = [p for p in at if p >= 0]
                if found:
                    seq.text, reason = seq.text[: min(found)], "stop"
        if reason is not None:
            self._on_finish(seq)
            out = (*seq.ids[seq.prompt_len :], *([token] if eos else []))
            send(seq, GenerationEvent(seq.text[seq.emitted :], reason, seq.prompt_len, seq.generated, out))
            return True
        if seq.stream:
            safe = len(seq.text) - held(seq.text, stops)
            if safe > seq.emitted:
                send(seq, GenerationEvent(seq.text[seq.emitted : safe]))
                seq.emitted = safe
        return seq.cancelled

    def detokenize(self, seq: SequenceState, flush: bool = False) -> str:
        """The text the newest tokens add; held back while it ends inside a multi-byte character (never sent
        as U+FFFD: at the end, bytes that make no whole character are left out)."""
        with self._tokenizer_lock:
            before = self.tokenizer.decode(
                seq.ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True
            )
            after = self.tokenizer.decode(seq.ids[seq.prefix_offset :], skip_special_tokens=True)
        added = after[len(before) :]
        if flush and added.endswith("\ufffd") and not added[:-1].endswith("\ufffd"):
            # the answer ends inside a character: no token will complete its first bytes, so none is sent
            # (a run of them is bytes that are no UTF-8 at all: shown, as decode() shows them)
            after = after[:-1]
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.ids)
            return after[len(before) :]
        return ""
