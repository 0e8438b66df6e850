"""Many LoRA adapters on one loaded base: registered by name, loaded on first use, evicted least recently
used past a limit, and mixed in one batch (PEFT's `adapter_names`: each row of a batch goes through its
own adapter's LoRA factors and head, over one pass of the shared base).

    gpuforge serve runs/a/model --adapter topics=runs/b/model --adapter sentiment=runs/c/model

The served model/ must itself be an adapter (its base is what the others share); every adapter must name
the same base source and task, with the same number of labels (their heads have one shape). Requests
name their adapter (`"adapter": "topics"`); without one they get the served model's own.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

from gpuforge.artifact import ArtifactError, Manifest, read_manifest
from gpuforge.errors import GpuforgeError

log = logging.getLogger("gpuforge.serve")
OWN = "default"  # PEFT's name for the adapter load_artifact loads


def check_adapters(model_dir: Path, adapters: dict[str, Path]) -> dict[str, Manifest]:
    """Each adapter's manifest, after checking it fits the served base; a GpuforgeError naming the one
    that does not."""
    base = read_manifest(model_dir)
    if adapters and not base.is_adapter:
        raise GpuforgeError(f"--adapter: {model_dir} is a full model; serve an adapter's model/ to add more")
    manifests = {}
    for name, path in adapters.items():
        where = f"--adapter {name}={path}"
        if name == OWN:
            raise GpuforgeError(f"{where}: the name {OWN!r} is taken by the served model's own adapter")
        try:
            manifest = read_manifest(path)
        except ArtifactError as err:
            raise GpuforgeError(f"{where}: {err}") from None
        if not manifest.is_adapter:
            raise GpuforgeError(f"{where}: a full model, not a LoRA adapter")
        for key in ("base", "task", "num_labels"):
            if getattr(manifest, key) != getattr(base, key):
                raise GpuforgeError(
                    f"{where}: its {key} is {getattr(manifest, key)!r}, "
                    f"the served base's is {getattr(base, key)!r}"
                )
        manifests[name] = manifest
    return manifests


class Adapters:
    """The adapters of one PeftModel. Loading and eviction happen in the model thread, between batches."""

    def __init__(
        self,
        peft_model,
        own_labels: list[str],
        registry: dict[str, Path],
        manifests: dict[str, Manifest],
        max_loaded: int = 8,
    ):
        self.model, self.registry, self.max_loaded = peft_model, dict(registry), max(1, max_loaded)
        self.labels = {OWN: own_labels, **{n: m.labels or own_labels for n, m in manifests.items()}}
        self.loaded: OrderedDict[str, None] = OrderedDict({OWN: None})  # least recently used first
        self.loads = self.evictions = 0
        self._lock = threading.Lock()

    def known(self, name: str) -> bool:
        return name == OWN or name in self.registry

    def names(self) -> list[str]:
        return [OWN, *self.registry]

    def ready(self, wanted: set[str]) -> None:
        """Load the adapters of `wanted` that are not loaded; past `max_loaded`, unload the least recently
        used others (a batch that needs more than the limit gets them all, and the excess goes after it)."""
        with self._lock:
            for name in wanted:
                if name in self.loaded:
                    self.loaded.move_to_end(name)
                    continue
                self._trim(wanted, room_for=1)
                self.model.load_adapter(str(self.registry[name]), adapter_name=name)
                self.loaded[name] = None
                self.loads += 1
                log.info("adapter %s loaded from %s", name, self.registry[name])
            self._trim(wanted, room_for=0)
            self.model.eval()

    def _trim(self, wanted: set[str], room_for: int) -> None:
        while len(self.loaded) + room_for > self.max_loaded:
            victim = next((n for n in self.loaded if n not in wanted and n != OWN), None)
            if victim is None:
                return  # every loaded adapter is needed now
            self.model.delete_adapter(victim)
            del self.loaded[victim]
            self.evictions += 1
            log.info("adapter %s evicted (least recently used)", victim)
