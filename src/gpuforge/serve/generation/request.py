"""One generation request: how it samples, the events it streams, and its state while it waits and runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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
class SequenceState:
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
    stream: bool = True  # text sent as it comes; else the whole answer in the last event, decoded once
    spent: dict[str, float] | None = None  # submitted while a profile window records: its time, by part
    window: Any = None  # that window (serve/profile.py): the request counts in it alone
    ended: float = 0.0  # when its last event was sent


def profiled(seqs: list[SequenceState]) -> bool:
    """Whether any of these counts in a profile window (only then are a step's parts timed)."""
    return any(seq.spent is not None for seq in seqs)
