"""The model step: forwards over the running batch with its KV cache, on the model thread alone.

Sequences of different lengths share the batch through left padding: an attention mask hides the padding
and explicit position_ids give each sequence its own positions. New prompts are prefilled together
(left-padded) in a forward of their own and then join: their keys and values are written into the next
rows of the batch's cache (batch_cache.py: tensors with room to spare, written in place), so that joining,
stepping and leaving never concatenate the whole cache. What each step's logits become (tokens, text,
whether a sequence ends) is output processing's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from gpuforge.runtime.kv_cache import cache_argument, cache_layers, returned_cache, with_layers
from gpuforge.serve.generation.batch_cache import BatchCache, write_in_place
from gpuforge.serve.generation.request import SequenceState


@dataclass
class Prefilled:
    """New prompts run together, not yet in the running batch: their last logits, per-layer (key, value)
    [B, heads, T, dim] with the padding zeroed, attention mask [B, T] and positions [B, T]."""

    logits: torch.Tensor  # [B, vocab]
    cache: Any  # the model's cache object: the form the running batch's window is handed to the model in
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    positions: torch.Tensor


class ModelStep:
    """The running batch of one causal LM: its sequences, their KV cache and attention mask (a BatchCache),
    next position [B] and next input token [B]."""

    def __init__(self, module: torch.nn.Module, device: torch.device, pad_id: int):
        self.module, self.device, self.pad_id = module, device, pad_id
        forward = inspect.signature(getattr(module, "get_base_model", lambda: module)().forward).parameters
        self._cache_arg = cache_argument(module)
        self._keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.running: list[SequenceState] = []
        self.cache = BatchCache(device)
        self._model_cache: Any = None  # the cache object the model is handed (WindowLayers, or refilled)
        self._writes_in_place = False  # whether the model's attention writes into the BatchCache itself
        self.positions = self.next = None

    @property
    def mask(self) -> torch.Tensor | None:
        """The running batch's attention mask [B, T] (a view), None with nobody running."""
        return self.cache.window_mask() if self.running else None

    def forward(self, ids, mask, positions, cache):
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        return self.module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self._keep_logits,
            **kwargs,
        )

    def warm_up(self) -> None:
        """A prefill and a decode step on a made-up prompt (the caller sets inference mode and autocast)."""
        ids = torch.full((1, 8), self.pad_id, device=self.device)
        out = self.forward(ids, torch.ones_like(ids), torch.arange(8, device=self.device)[None], None)
        mask = torch.ones(1, 9, dtype=torch.long, device=self.device)
        self.forward(ids[:, :1], mask, torch.tensor([[8]], device=self.device), returned_cache(out))

    def prefill(self, seqs: list[SequenceState]) -> Prefilled:
        """Run the new prompts together, left-padded."""
        length = max(len(s.ids) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, length - len(seq.ids) :] = torch.tensor(seq.ids)
            mask[i, length - len(seq.ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.forward(ids, mask, positions, None)
        cache = returned_cache(out)
        hidden = (mask == 0)[:, None, :, None]
        kv = [(k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)) for k, v in cache_layers(cache)]
        return Prefilled(out.logits[:, -1, :], cache, kv, mask, positions)  # zeroed: padding stays finite

    def join(self, prefilled: Prefilled, seqs: list[SequenceState], going: list[bool]) -> None:
        """Merge the prefilled sequences that go on (their first token taken) into the running batch."""
        if not any(going):
            return
        joining = [s for s, g in zip(seqs, going, strict=True) if g]
        if all(going):
            kv, mask, last = prefilled.kv, prefilled.mask, prefilled.positions[:, -1]
        else:
            keep = torch.tensor([i for i, g in enumerate(going) if g], device=self.device)
            kv = [(k[keep], v[keep]) for k, v in prefilled.kv]
            mask, last = prefilled.mask[keep], prefilled.positions[keep, -1]
        next_ids = torch.tensor([s.ids[-1] for s in joining], device=self.device)
        if not self.running:
            self._use_cache_of(prefilled.cache)
            self.positions, self.next = last + 1, next_ids
        else:
            self.positions = torch.cat([self.positions, last + 1])
            self.next = torch.cat([self.next, next_ids])
        self.cache.admit(kv, mask)
        self.running.extend(joining)

    def _use_cache_of(self, returned: Any) -> None:
        """Hand the model the window in the form its forward returned: a DynamicCache of plain layers
        gets WindowLayers (its attention writes in place); any other form is refilled at every step."""
        if not self._writes_in_place:  # once it writes in place, the cache object from before serves again
            self._writes_in_place = write_in_place(returned, self.cache)
            self._model_cache = returned

    def decode(self, synchronize: bool = False) -> torch.Tensor:
        """One forward of every running sequence's next token: the logits [B, vocab] of the token after.
        `synchronize` waits for a GPU's forward to end (a profiled step times it, not its launch)."""
        self.cache.open_column()
        mask, ids, positions = self.cache.window_mask(extra=1), self.next[:, None], self.positions[:, None]
        if self._writes_in_place:
            out = self.forward(ids, mask, positions, self._model_cache)
        else:  # the model gives its cache back grown by this step's column: that column is kept
            out = self.forward(ids, mask, positions, with_layers(self._model_cache, self.cache.window()))
            for layer, (k, v) in enumerate(cache_layers(returned_cache(out))):
                self.cache.write_column(layer, k[:, :, -1:], v[:, :, -1:])
        self.cache.close_column()
        self.positions = self.positions + 1
        if synchronize:
            torch.cuda.synchronize(self.device)
        return out.logits[:, -1, :]

    def feed(self, tokens: list[int]) -> None:
        """The tokens sampled from the last decode: the running sequences' next inputs."""
        self.next = torch.tensor(tokens, device=self.device)

    def leave(self, gone: list[bool]) -> None:
        """Drop the sequences marked gone from the batch (the last ones move into their rows), and the
        padding columns nobody needs."""
        if not any(gone):
            return
        order = self.cache.remove(gone)
        self.running = [self.running[i] for i in order]
        if not order:
            self.positions = self.next = None
            return
        index = torch.tensor(order, device=self.device)
        self.positions, self.next = self.positions[index], self.next[index]

    def clear(self) -> None:
        """Forget the running batch (after a failed step: its requests were told why)."""
        self.running = []
        self.cache.clear()
        self.positions = self.next = None


def context_length(config: Any) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model's config names no context length; pass max_context")
