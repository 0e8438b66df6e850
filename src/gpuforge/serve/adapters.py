"""Many LoRA adapters on one loaded base: registered by name, loaded on first use, evicted least recently
used past a limit, and mixed in one batch (PEFT's `adapter_names`: each row of a batch goes through its
own adapter's LoRA factors and head, over one pass of the shared base).

    gpuforge serve runs/a/model --adapter topics=runs/b/model --adapter sentiment=runs/c/model

The served model/ must itself be an adapter (its base is what the others share); every adapter must name
the same base source and task, with the same number of labels (their heads have one shape). Requests
name their adapter (`"adapter": "topics"`); without one they get the served model's own. A running worker
may take more, and let them go (POST and DELETE /admin/adapters, serve/classifier_backend.py).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path

from gpuforge.artifact import ArtifactError, Manifest, read_manifest
from gpuforge.errors import GpuforgeError

log = logging.getLogger("gpuforge.serve")
OWN = "default"  # PEFT's name for the adapter load_artifact loads
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
NAME_MAX = 100


class AdapterConflict(GpuforgeError):
    """The name is registered already, for another adapter."""


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
        if len(name) > NAME_MAX or not re.fullmatch(NAME_PATTERN, name):
            raise GpuforgeError(f"{where}: a name is up to {NAME_MAX} letters, digits, '.', '_' or '-', "
                                "the first a letter or digit")  # fmt: skip
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
    """The adapters of one PeftModel. Loading, eviction and removal happen in the model thread, between
    batches (`ready`); `add` and `remove` may come from any thread, and only change what `ready` does next.

    `registry` and `labels` are replaced whole on a change, never changed in place: a request's thread
    reads them without the lock (which `ready` holds while an adapter loads), and sees one or the other."""

    def __init__(
        self,
        peft_model,
        own_labels: list[str],
        registry: dict[str, Path],
        manifests: dict[str, Manifest],
        max_loaded: int = 8,
    ):
        self.model, self.registry, self.max_loaded = peft_model, dict(registry), max(1, max_loaded)
        self.own_labels = own_labels
        self.labels = {OWN: own_labels, **{n: m.labels or own_labels for n, m in manifests.items()}}
        self.loaded: OrderedDict[str, None] = OrderedDict({OWN: None})  # least recently used first
        self.removed: set[str] = set()  # loaded weights to delete at the next batch (some re-added since)
        self.loads = self.evictions = 0
        self._lock = threading.Lock()

    def known(self, name: str) -> bool:
        return name == OWN or name in self.registry

    def names(self) -> list[str]:
        return [OWN, *self.registry]

    def unknown(self, name: str) -> str:
        """What a request naming an adapter not served is told."""
        return f"adapter: unknown adapter {name!r} (served: {', '.join(self.names())})"

    def add(self, name: str, path: Path, manifest: Manifest) -> bool:
        """Register `name` at `path` (checked by check_adapters); it loads on first use. False when it is
        registered at `path` already; an AdapterConflict when it is registered elsewhere."""
        with self._lock:
            if self.registered(name, path):
                return False
            self.registry = {**self.registry, name: path}
            self.labels = {**self.labels, name: manifest.labels or self.own_labels}
        log.info("adapter %s registered at %s", name, path)
        return True

    def registered(self, name: str, path: Path) -> bool:
        """Whether `name` is registered at `path`; an AdapterConflict when it is taken by another."""
        if name == OWN:
            raise AdapterConflict(f"name: {OWN!r} is the served model's own adapter")
        there = self.registry.get(name)
        if there is not None and Path(there).resolve() != Path(path).resolve():
            raise AdapterConflict(f"name: {name!r} is registered already, at {there}")
        return there is not None

    def remove(self, name: str) -> None:
        """Forget `name` (registered, not OWN): requests naming it are refused from now on; its weights
        go in the model thread before the next batch, never under a forward that may be using them."""
        with self._lock:
            self.registry = {n: p for n, p in self.registry.items() if n != name}
            self.labels = {n: labels for n, labels in self.labels.items() if n != name}
            self.removed.add(name)
        log.info("adapter %s removed", name)

    def ready(self, wanted: set[str]) -> dict[str, list[str]]:
        """In the model thread, before a batch: delete the weights of those removed, load the adapters of
        `wanted` that are not loaded; past `max_loaded`, unload the least recently used others (a batch
        that needs more than the limit gets them all, and the excess goes after it). The labels of each
        of `wanted` still registered; one removed since its request came is left out."""
        with self._lock:
            self._delete_removed()
            serving = {name: self.labels[name] for name in wanted if self.known(name)}
            fresh = [name for name in serving if name not in self.loaded]
            for name in serving.keys() - fresh:
                self.loaded.move_to_end(name)
            for name in fresh:
                self._trim(serving.keys(), room_for=1)
                self.model.load_adapter(str(self.registry[name]), adapter_name=peft_name(name))
                self.loaded[name] = None
                self.loads += 1
                log.info("adapter %s loaded from %s", name, self.registry[name])
            self._trim(serving.keys(), room_for=0)
            if fresh:
                self.model.eval()  # a freshly loaded adapter's dropout is in training mode
            return serving

    def peft_names(self, names: list[str]) -> list[str]:
        return [peft_name(name) for name in names]

    def _delete_removed(self) -> None:
        for name in self.removed & self.loaded.keys():
            self.model.delete_adapter(peft_name(name))
            del self.loaded[name]
            log.info("adapter %s unloaded (removed)", name)
        self.removed.clear()

    def _trim(self, wanted, room_for: int) -> None:
        while len(self.loaded) + room_for > self.max_loaded:
            victim = next((n for n in self.loaded if n not in wanted and n != OWN), None)
            if victim is None:
                return  # every loaded adapter is needed now
            self.model.delete_adapter(peft_name(victim))
            del self.loaded[victim]
            self.evictions += 1
            log.info("adapter %s evicted (least recently used)", victim)


def peft_name(name: str) -> str:
    """The name PEFT knows adapter `name` by: PEFT keeps adapters in torch ModuleDicts, which refuse a
    key with a "." or one that is an attribute of theirs ("train", "keys"), and a failed load leaves the
    model half changed. `~` is no name's (NAME_PATTERN), so no two names meet."""
    return OWN if name == OWN else "gf-" + name.replace(".", "~")
