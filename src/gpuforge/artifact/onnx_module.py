"""An ONNX export run by onnxruntime behind a torch module's face: `module(input_ids, attention_mask=...)`
or `module(pixel_values)` gives logits as a torch tensor, so evaluation, the endpoint's batches and the
compression report take it as they take the model it was exported from.

It holds no parameters and cannot train; `.to()` and `.eval()` do nothing that matters. onnxruntime (the
`gpuforge[export]` extra) is imported when an export is loaded, never before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpuforge.errors import ModelError

ONNX_INSTALL = "pip install 'gpuforge[export]' (onnx, onnxruntime)"


class OnnxModule(torch.nn.Module):
    def __init__(
        self, path: Path, inputs: list[str], device: torch.device | str = "cpu", threads: int | None = None
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

    def forward(self, main: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        given = {self.inputs[0]: main}
        if "attention_mask" in self.inputs:  # a batch without one (a causal LM's) attends to every token
            given["attention_mask"] = attention_mask if attention_mask is not None else torch.ones_like(main)
        feed = {name: _numpy(tensor, name) for name, tensor in given.items()}
        (logits,) = self.session.run(None, feed)
        return torch.from_numpy(logits).to(main.device)  # where the caller's batch is (cuda: copied back)


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
