"""The running batch's key/value cache, kept in tensors with room to spare and written in place.

Per layer, keys and values are [rows, heads, columns, dim] tensors allocated with spare rows and columns;
the attention mask is [rows, columns] beside them. The running sequences are the first `rows` rows, their
tokens right-aligned to column `end` (left padding, hidden by the mask): the live window is columns
[start, end). A decode step writes one column at `end`; newcomers are written into the next free rows,
their prompts ending at `end`; a sequence that leaves is replaced by one of the last rows. Only growing
(doubling rows or columns) or sliding the window back to column 0 copies the live window, and that is
seldom: no admission or step concatenates whole caches.

A transformers DynamicCache of plain layers gets `WindowLayer`s in place of its own, so that the model's
attention writes its new keys and values straight into the window. Any other form (an ONNX export's
tuples, a sliding window's layers) is handed the window as it is and gives back the cache grown by the new
column, which is copied in.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # transformers >= 4.56 keeps a DynamicCache as a list of layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older forms are served through the copy of the new column
    DynamicLayer = None


class BatchCache:
    """The keys, values and attention mask of the running batch: rows [0, rows), columns [start, end)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.keys: list[torch.Tensor] = []  # per layer [row capacity, heads, column capacity, dim]
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.rows = self.start = self.end = 0

    @property
    def width(self) -> int:
        return self.end - self.start

    def window(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of the running rows and the live columns: views, not copies."""
        return [self.layer_window(i) for i in range(len(self.keys))]

    def layer_window(self, layer: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        span = slice(self.start, self.end + extra)
        return self.keys[layer][: self.rows, :, span], self.values[layer][: self.rows, :, span]

    def window_mask(self, extra: int = 0) -> torch.Tensor:
        return self.mask[: self.rows, self.start : self.end + extra]

    # -- admitting, stepping, leaving -----------------------------------------------------------------

    def admit(self, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Write newcomers (per layer [n, heads, length, dim], their padding zeroed, and mask [n, length])
        into the next rows, their last token in the column before `end`."""
        n, length = mask.shape
        if self.rows == 0:
            self.start = self.end = 0
            if not self._fits(kv):
                self._allocate_like(kv, rows=max(n, 4), columns=2 * length + 32)
        if length > self.end:  # a prompt longer than the batch so far: the window moves right
            self._reshape(self.rows + n, offset=length - self.width, columns=length + 1)
        elif self.rows + n > self.mask.shape[0]:
            self._reshape(self.rows + n, offset=self.start, columns=self.end + 1)
        rows, columns = slice(self.rows, self.rows + n), slice(self.end - length, self.end)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][rows, :, columns] = k
            self.values[layer][rows, :, columns] = v
        self.mask[rows] = 0
        self.mask[rows, columns] = mask
        self.rows += n
        self.start = min(self.start, self.end - length)  # columns it reopens are 0 in the older rows' mask

    def open_column(self) -> None:
        """Make room for this step's token at column `end` and show it to every running row."""
        capacity = self.mask.shape[1]
        if self.end == capacity and self.width + 1 <= capacity // 2:  # sliding back frees half
            self._reshape(self.rows, offset=0, columns=self.width + 1)
        elif self.end == capacity:
            self._reshape(self.rows, offset=self.start, columns=self.end + 1)
        self.mask[: self.rows, self.end] = 1

    def write_column(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This step's keys and values of one layer ([rows, heads, 1, dim]) into column `end`."""
        self.keys[layer][: self.rows, :, self.end : self.end + 1] = keys
        self.values[layer][: self.rows, :, self.end : self.end + 1] = values

    def close_column(self) -> None:
        self.end += 1

    def remove(self, gone: list[bool]) -> list[int]:
        """Drop the rows marked gone: the last rows kept move into their places. Returns, for each row
        now, the row it was; the columns no remaining row needs fall out of the window."""
        kept = [i for i, g in enumerate(gone) if not g]
        order = list(range(len(kept)))
        holes = [i for i in order if gone[i]]
        movers = [i for i in kept if i >= len(kept)]
        if holes:
            to = torch.tensor(holes, device=self.device)
            source = torch.tensor(movers, device=self.device)
            for tensor in [*self.keys, *self.values]:
                tensor[to, :, self.start : self.end] = tensor[source, :, self.start : self.end]
            self.mask[to] = self.mask[source]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        self.rows = len(kept)
        if self.rows == 0:
            self.start = self.end = 0
        else:
            used = self.window_mask().any(dim=0).nonzero()
            self.start += int(used[0]) if len(used) else self.width
        return order

    def clear(self) -> None:
        self.rows = self.start = self.end = 0

    # -- room -----------------------------------------------------------------------------------------

    def _reshape(self, rows: int, offset: int, columns: int) -> None:
        """Room for `rows` rows and `columns` columns, the live window moved to start at column `offset`:
        the tensors doubled where they are short (the window copied over), else the window slides in place."""
        capacity_rows, capacity_columns = self.mask.shape
        grown_rows = capacity_rows if rows <= capacity_rows else max(rows, 2 * capacity_rows)
        grown_columns = max(columns, 2 * capacity_columns) if columns > capacity_columns else capacity_columns
        live, moved, used = slice(self.start, self.end), slice(offset, offset + self.width), self.rows
        if (grown_rows, grown_columns) != (capacity_rows, capacity_columns):
            self.keys = [_grown(t, grown_rows, grown_columns, live, moved, used) for t in self.keys]
            self.values = [_grown(t, grown_rows, grown_columns, live, moved, used) for t in self.values]
            mask = self.mask.new_zeros((grown_rows, grown_columns))
            mask[:used, moved] = self.mask[:used, live]
            self.mask = mask
        elif offset != self.start:  # clone first: the two spans may overlap
            for tensor in [*self.keys, *self.values]:
                tensor[:used, :, moved] = tensor[:used, :, live].clone()
            window = self.mask[:used, live].clone()
            self.mask[:used] = 0  # the columns left behind would show stale tokens once the window widens
            self.mask[:used, moved] = window
        self.start, self.end = offset, offset + self.width

    def _allocate_like(self, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, columns: int) -> None:
        """Empty tensors shaped for these layers (heads, dim, dtype), with room for `rows` and `columns`."""
        self.keys = [k.new_zeros((rows, k.shape[1], columns, k.shape[3])) for k, _ in kv]
        self.values = [v.new_zeros((rows, v.shape[1], columns, v.shape[3])) for _, v in kv]
        self.mask = torch.zeros((rows, columns), dtype=torch.long, device=self.device)

    def _fits(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether these layers' heads, dim and dtype are the ones allocated."""
        return len(kv) == len(self.keys) and all(
            k.shape[1] == mine.shape[1] and k.shape[3] == mine.shape[3] and k.dtype == mine.dtype
            for (k, _), mine in zip(kv, self.keys, strict=True)
        )


def _grown(tensor, rows: int, columns: int, live: slice, moved: slice, used: int) -> torch.Tensor:
    bigger = tensor.new_zeros((rows, tensor.shape[1], columns, tensor.shape[3]))
    bigger[:used, :, moved] = tensor[:used, :, live]
    return bigger


def write_in_place(cache: Any, batch: BatchCache) -> bool:
    """Give a transformers DynamicCache of plain layers WindowLayers onto `batch` in place of its own, so
    that the model's attention writes into it (True); False for any other form, left as it is."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return False
    cache.layers = [WindowLayer(batch, i) for i in range(len(layers))]
    return True


if DynamicLayer is not None:

    class WindowLayer(DynamicLayer):
        """One layer of a transformers DynamicCache that is a window onto a BatchCache: the model's
        attention writes this step's keys and values into column `end` and reads the window up to it."""

        def __init__(self, batch: BatchCache, layer: int):  # no DynamicLayer state: the batch holds it
            self.batch, self.layer = batch, layer
            self.is_initialized = True
            self.device = batch.device

        @property
        def keys(self) -> torch.Tensor:
            return self.batch.layer_window(self.layer)[0]

        @property
        def values(self) -> torch.Tensor:
            return self.batch.layer_window(self.layer)[1]

        def update(self, key_states, value_states, *args, **kwargs):
            self.batch.write_column(self.layer, key_states, value_states)
            return self.batch.layer_window(self.layer, extra=1)

        def get_seq_length(self) -> int:
            return self.batch.width

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.batch.width + query_length, 0
