"""The run's model/ directory: the trained model plus gpuforge.json saying how to load it.

transformers models are saved with save_pretrained (loadable by transformers alone); other modules as
model.safetensors beside the source and options that rebuild them. manifest.py is gpuforge.json's typed
model, save.py writes a directory, load.py reads one, origin.py finds the run it came from.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gpuforge.artifact.manifest import MANIFEST, ArtifactError, Manifest, read_manifest, write_manifest

if TYPE_CHECKING:
    from gpuforge.artifact.load import built_from, load_artifact, load_saved_tokenizer
    from gpuforge.artifact.save import save_artifact

# loading and saving import torch; the manifest alone does not (the server reads it without torch)
_LAZY = {
    "built_from": "load",
    "load_artifact": "load",
    "load_saved_tokenizer": "load",
    "save_artifact": "save",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"gpuforge.artifact.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gpuforge.artifact' has no attribute {name!r}")


__all__ = [
    "MANIFEST",
    "ArtifactError",
    "Manifest",
    "built_from",
    "load_artifact",
    "load_saved_tokenizer",
    "read_manifest",
    "save_artifact",
    "write_manifest",
]
