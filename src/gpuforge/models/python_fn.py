"""`python:<module>:<fn>`: user code that returns an nn.Module. `module` is an importable name or a .py path.

The function gets the keyword arguments it declares among: task, num_labels, vocab_size, max_length,
plus everything in model.options.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from torch import nn

from gpuforge.errors import ModelError
from gpuforge.models.base import BuiltModel, ModelRequest


def options(source: str) -> None:
    return None  # user code takes what it declares (python: models need user code: an admin key)


def tokenizer(source: str):
    return None  # user modules bring no tokenizer: text tasks name data.tokenizer


def _import(module_ref: str):
    if module_ref.endswith(".py"):
        path = Path(module_ref)
        if not path.is_file():
            raise ModelError(f"model.source: {path}: no such file")
        name = "gpuforge_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise ModelError(f"model.source: importing {path} failed: {type(err).__name__}: {err}") from None
        return module
    try:
        return importlib.import_module(module_ref)
    except ImportError as err:
        raise ModelError(f"model.source: cannot import module '{module_ref}': {err}") from None


def resolve(source: str):
    module_ref, fn_name = source.partition(":")[2].rsplit(":", 1)
    fn = getattr(_import(module_ref), fn_name, None)
    if not callable(fn):
        raise ModelError(f"model.source: {module_ref} has no function '{fn_name}'")
    return fn


def build(request: ModelRequest) -> BuiltModel:
    fn = resolve(request.source)
    offered = {
        "task": request.task,
        "num_labels": request.num_labels,
        "vocab_size": request.vocab_size,
        "max_length": request.max_length,
    }
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # what gpuforge offers goes only where declared; model.options always go, so a typo is an error
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params} | dict(request.options)
    try:
        module = fn(**kwargs)
    except Exception as err:
        raise ModelError(f"model.source: {request.source} raised {type(err).__name__}: {err}") from None
    if not isinstance(module, nn.Module):
        raise ModelError(
            f"model.source: {request.source} returned {type(module).__name__}, not a torch nn.Module"
        )
    return BuiltModel(module, False, f"{request.source} ({type(module).__name__})", {"pretrained": False})
