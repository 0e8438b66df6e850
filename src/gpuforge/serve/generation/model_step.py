"""The model step: forwards over the running batch with its KV cache, on the model thread alone.

Sequences of different lengths share the batch through left padding: an attention mask hides the padding
and explicit position_ids give each sequence its own positions. New prompts are prefilled together
(left-padded) and then join: both caches are padded on the left to one length and concatenated on the
batch axis. Leaving index-selects the others and drops the padding columns no remaining sequence needs.
What each step's logits become (tokens, text, whether a sequence ends) is output processing's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from gpuforge.runtime.kv_cache import cache_argument, cache_layers, returned_cache, with_layers
from gpuforge.serve.generation.request import SequenceState


@dataclass
class Prefilled:
    """New prompts run together, not yet in the running batch: their last logits, per-layer (key, value)
    [B, heads, T, dim] with the padding zeroed, attention mask [B, T] and positions [B, T]."""

    logits: torch.Tensor  # [B, vocab]
    cache: Any  # the model's cache object, the container the merged layers go back into
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    positions: torch.Tensor


class ModelStep:
    """The running batch of one causal LM: its sequences, their KV cache [B, heads, T, dim] per layer,
    attention mask [B, T], next position [B] and next input token [B]."""

    def __init__(self, module: torch.nn.Module, device: torch.device, pad_id: int):
        self.module, self.device, self.pad_id = module, device, pad_id
        forward = inspect.signature(getattr(module, "get_base_model", lambda: module)().forward).parameters
        self._cache_arg = cache_argument(module)
        self._keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.running: list[SequenceState] = []
        self.cache: Any = None
        self.mask = self.positions = self.next = None

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
        keep = torch.tensor([i for i, g in enumerate(going) if g], device=self.device)
        kv = [(k[keep], v[keep]) for k, v in prefilled.kv]
        mask, positions = prefilled.mask[keep], prefilled.positions[keep, -1] + 1
        joining = [s for s, g in zip(seqs, going, strict=True) if g]
        next_ids = torch.tensor([s.ids[-1] for s in joining], device=self.device)
        if not self.running:
            self.cache = with_layers(prefilled.cache, kv)
            self.mask, self.positions, self.next = mask, positions, next_ids
        else:  # pad both on the left to one length, then one batch
            width = max(self.mask.shape[1], mask.shape[1])
            old = [(_pad_left(k, width), _pad_left(v, width)) for k, v in cache_layers(self.cache)]
            new = [(_pad_left(k, width), _pad_left(v, width)) for k, v in kv]
            merged = [(torch.cat([a, c]), torch.cat([b, d])) for (a, b), (c, d) in zip(old, new, strict=True)]
            self.cache = with_layers(self.cache, merged)
            self.mask = torch.cat([_pad_left(self.mask, width, dim=1), _pad_left(mask, width, dim=1)])
            self.positions = torch.cat([self.positions, positions])
            self.next = torch.cat([self.next, next_ids])
        self.running.extend(joining)

    def decode(self, synchronize: bool = False) -> torch.Tensor:
        """One forward of every running sequence's next token: the logits [B, vocab] of the token after.
        `synchronize` waits for a GPU's forward to end (a profiled step times it, not its launch)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.running), 1))], dim=1)
        out = self.forward(self.next[:, None], self.mask, self.positions[:, None], self.cache)
        self.cache = returned_cache(out)
        self.positions = self.positions + 1
        if synchronize:
            torch.cuda.synchronize(self.device)
        return out.logits[:, -1, :]

    def feed(self, tokens: list[int]) -> None:
        """The tokens sampled from the last decode: the running sequences' next inputs."""
        self.next = torch.tensor(tokens, device=self.device)

    def leave(self, gone: list[bool]) -> None:
        """Drop the sequences marked gone from the batch, and the padding columns nobody needs."""
        if not any(gone):
            return
        keep = [i for i, g in enumerate(gone) if not g]
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.positions = self.next = None
            return
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0  # columns before it are padding in every row left
        self.mask = mask[:, first:]
        self.cache = with_layers(
            self.cache, [(k[index, :, first:], v[index, :, first:]) for k, v in cache_layers(self.cache)]
        )
        self.positions, self.next = self.positions[index], self.next[index]

    def clear(self) -> None:
        """Forget the running batch (after a failed step: its requests were told why)."""
        self.running, self.cache = [], None
        self.mask = self.positions = self.next = None


def context_length(config: Any) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model's config names no context length; pass max_context")


def _pad_left(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
