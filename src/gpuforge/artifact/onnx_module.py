"""An ONNX export run by onnxruntime behind a torch module's face: `module(input_ids, attention_mask=...)`
or `module(pixel_values)` gives logits as a torch tensor, so evaluation, the endpoint's batches and the
compression report take it as they take the model it was exported from. A causal LM exported with its
key/value cache also answers the generation engine's call (serve/generate.py) as a transformers model
does: `module(input_ids=, attention_mask=, position_ids=, past_key_values=, use_cache=True)` gives an
output with `.logits` and `.past_key_values` (per layer (keys, values)).

It holds no parameters and cannot train; `.to()` and `.eval()` do nothing that matters. onnxruntime (the
`gpuforge[export]` extra) is imported when an export is loaded, never before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from gpuforge.artifact.manifest import OnnxCacheRecord
from gpuforge.errors import ModelError

ONNX_INSTALL = "pip install 'gpuforge[export]' (onnx, onnxruntime)"


class OnnxModule(torch.nn.Module):
    def __init__(
        self,
        path: Path,
        inputs: list[str],
        device: torch.device | str = "cpu",
        threads: int | None = None,
        cache: OnnxCacheRecord | None = None,
        max_positions: int | None = None,
    ):
        super().__init__()
        try:
            import onnxruntime
        except ImportError:
            raise ModelError(f"{path}: an ONNX export needs onnxruntime: {ONNX_INSTALL}") from None
        options = onnxruntime.SessionOptions()
        # the threads this process was given (a CPU slot's share), as torch uses them
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # idle threads sleep rather than spin between batches: spinning took the cores the server and
        # its neighbours needed (benchmarks/export.py: the CNN served at 0.7x torch with it, ~1x without)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            self.session = onnxruntime.InferenceSession(
                str(path), options, providers=_providers(onnxruntime.get_available_providers(), device)
            )
        except Exception as err:  # onnxruntime raises its own types: an opset or operator it cannot run
            raise ModelError(f"{path}: onnxruntime cannot run this graph: {_first_line(err)}") from None
        self.inputs = list(inputs)
        self.provider = self.session.get_providers()[0]
        # where the logits are: a CPU-only onnxruntime on a GPU machine runs on the CPU
        self.device = (
            torch.device(device) if self.provider == "CUDAExecutionProvider" else torch.device("cpu")
        )
        self.cache = cache
        # what the generation engine reads of a transformers model: its context and where text ends
        self.config = SimpleNamespace(
            max_position_embeddings=max_positions, vocab_size=cache.vocab_size if cache else None
        )
        self.generation_config = SimpleNamespace(eos_token_id=list(cache.eos_token_ids) if cache else None)

    def forward(
        self,
        main: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: tuple | None = None,
        use_cache: bool = False,
    ):
        main = input_ids if main is None else main
        if self.cache is not None:
            return self._with_cache(main, attention_mask, position_ids, past_key_values, use_cache)
        given = {self.inputs[0]: main}
        if "attention_mask" in self.inputs:  # a batch without one (a causal LM's) attends to every token
            given["attention_mask"] = attention_mask if attention_mask is not None else torch.ones_like(main)
        feed = {name: _numpy(tensor, name) for name, tensor in given.items()}
        (logits,) = self.session.run(None, feed)
        return torch.from_numpy(logits).to(main.device)  # where the caller's batch is (cuda: copied back)

    def _with_cache(self, ids, attention_mask, position_ids, past, use_cache: bool):
        """One pass of the graph with its cache: none given is an empty one (a whole sequence's pass), a
        mask none given attends to every token, positions none given follow the cache (torch's default)."""
        batch, length = ids.shape
        if past is None:
            empty = np.zeros((batch, self.cache.heads, 0, self.cache.head_dim), np.float32)
            past = [(empty, empty)] * self.cache.layers
        held = past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(batch, held + length, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(held, held + length)[None].expand(batch, -1)
        feed = {
            "input_ids": _numpy(ids, "input_ids"),
            "attention_mask": _numpy(attention_mask, "attention_mask"),
            "position_ids": _numpy(position_ids, "position_ids"),
        }
        for layer, (keys, values) in enumerate(past):
            feed[f"past_key_{layer}"], feed[f"past_value_{layer}"] = _floats(keys), _floats(values)
        logits, *present = self.session.run(None, feed)
        logits = torch.from_numpy(logits).to(ids.device)
        if not use_cache:
            return logits
        tensors = [torch.from_numpy(t).to(ids.device) for t in present]
        kv = tuple((tensors[2 * i], tensors[2 * i + 1]) for i in range(self.cache.layers))
        return CausalOutput(logits, kv)


@dataclass
class CausalOutput:
    """What a transformers causal LM returns, as far as the generation engine reads it."""

    logits: torch.Tensor
    past_key_values: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _floats(tensor) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    return tensor.detach().float().cpu().numpy()


def _numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    if name == "pixel_values":
        return tensor.detach().float().cpu().numpy()
    return tensor.detach().to(torch.int64).cpu().numpy()


def _providers(available: list[str], device: torch.device | str) -> list:
    """CUDA for a cuda device where this onnxruntime build has it (on that GPU), the CPU always (it runs
    what CUDA does not)."""
    device = torch.device(device)
    if device.type == "cuda" and "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:500] if text else type(err).__name__
