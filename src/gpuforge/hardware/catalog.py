"""Accelerators teams buy or rent, by datasheet: what `gpuforge plan --compare` weighs and what `gpuforge hw`
holds a measured peak against.

The catalog ships beside this module (devices.yaml: dated, every figure with its source). A user's
$GPUFORGE_HOME/devices.yaml, in the same format, is merged over it:

    devices:
      h100-sxm: {usd_per_hour: 1.99}                 # a shipped device: only the fields given change
      a100-80gb:                                     # one you own: its hourly cost from its parts
        price: {purchase_usd: 15000, years: 4, watts: 400, usd_per_kwh: 0.15, utilisation: 0.6}
      my-gpu:                                        # a new device needs name, kind, memory_gb,
        name: My GPU                                 #   memory_bandwidth_gbs and tflops (one precision
        kind: cuda                                   #   at least); torch defaults to true
        memory_gb: 32
        memory_bandwidth_gbs: 900
        tflops: {bf16: 200}

`tflops` and `sources` merge precision by precision; a figure the file changes takes the file as its source
unless the entry names one. `price` is prices.DevicePrice: `usd_per_hour` becomes its hourly cost.
`match` names a model by how torch.cuda.get_device_name() ends (whole words, any case); see datasheet_for.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, model_validator

from gpuforge.errors import SpecError
from gpuforge.prices import DevicePrice
from gpuforge.settings import current

CATALOG_FILE = "devices.yaml"  # also the user's override file name under $GPUFORGE_HOME
Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
FIGURES = (
    "memory_gb",
    "memory_bandwidth_gbs",
    "tflops",
    "watts",
    "usd_per_hour",
    "interconnect_gbs",
    "host_link_gbs",
)
RESERVED = "cpu"  # the local CPU is measured (hardware/bench.py), never looked up
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*\Z")
_SOURCE_KEYS = frozenset(FIGURES) | {f"tflops.{p}" for p in PRECISIONS}


@dataclass(frozen=True)
class CatalogDevice:
    key: str  # "h100-sxm"
    name: str
    kind: str  # cuda | rocm | tpu | cpu
    torch: bool
    memory_bytes: int  # memory_gb * 1e9
    memory_bandwidth_gbs: float
    tflops: dict[str, float]  # dense, per precision present
    watts: float | None
    usd_per_hour: float | None  # a typical on-demand price, or an owned device's hourly cost
    interconnect_gbs: float | None
    host_link_gbs: float | None
    aliases: tuple[str, ...]
    match: tuple[str, ...]
    sources: dict[str, str]
    origin: str  # "shipped (2026-12-01)" or the override file's path


class _Entry(BaseModel):
    """One device as the files write it, after an override is merged over its shipped entry."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    kind: Literal["cuda", "rocm", "tpu"]
    torch: bool = True
    memory_gb: float = Field(gt=0, le=1e6)
    memory_bandwidth_gbs: float = Field(gt=0, le=1e6)
    tflops: dict[Precision, PositiveFloat] = Field(min_length=1)
    watts: float | None = Field(None, gt=0, le=1e5)
    usd_per_hour: float | None = Field(None, ge=0, le=1e4)
    price: DevicePrice | None = None
    interconnect_gbs: float | None = Field(None, gt=0, le=1e6)
    host_link_gbs: float | None = Field(None, gt=0, le=1e6)
    aliases: list[str] = []
    match: list[str] = []
    sources: dict[str, str] = {}

    @model_validator(mode="after")
    def _consistent(self) -> _Entry:
        if self.usd_per_hour is not None and self.price is not None:
            raise ValueError("either usd_per_hour or price, not both")
        for alias in self.aliases:
            if not _NAME.match(alias) or alias == RESERVED:
                raise ValueError(f"alias {alias!r}: lowercase letters, digits and '-', and not {RESERVED!r}")
        if any(not text.strip() for text in self.match):
            raise ValueError("match: an empty name matches every device")
        unknown = sorted(set(self.sources) - _SOURCE_KEYS)
        if unknown:
            raise ValueError(f"sources: {unknown[0]!r} is not a figure ({', '.join(FIGURES)})")
        return self

    def hourly(self) -> float | None:
        return self.price.hourly() if self.price is not None else self.usd_per_hour


def load_catalog(home: Path | None = None) -> dict[str, CatalogDevice]:
    """The shipped catalog, with $GPUFORGE_HOME/devices.yaml merged over it (home defaults to
    gpuforge.settings.current().home)."""
    if home is None:
        home = current().home
    shipped_path, when, shipped = _shipped()
    override_path = Path(home) / CATALOG_FILE
    try:
        _, overrides = _read(override_path)
    except FileNotFoundError:
        overrides = {}
    entries: dict[str, tuple[Path, str, dict[str, Any]]] = {
        key: (shipped_path, f"shipped ({when})", raw) for key, raw in shipped.items()
    }
    for key, patch in overrides.items():
        base = entries[key][2] if key in entries else {}
        entries[key] = (override_path, str(override_path), _merged(base, patch, override_path))
    catalog = {key: _device(path, key, raw, origin) for key, (path, origin, raw) in entries.items()}
    # the user's entries last, so that a clash is blamed on the file that made it
    order = [key for key in catalog if key not in overrides] + list(overrides)
    _check_unique([catalog[key] for key in order], {key: path for key, (path, _, _) in entries.items()})
    return catalog


def resolve(catalog: dict[str, CatalogDevice], name: str) -> CatalogDevice:
    """By key or alias, case-insensitive; an unknown name raises SpecError listing the known keys (sorted)."""
    wanted = name.strip().lower()
    if wanted in catalog:
        return catalog[wanted]
    for device in catalog.values():
        if wanted in device.aliases:
            return device
    raise SpecError(f"unknown device {name!r}: the catalog knows {', '.join(sorted(catalog))}")


def datasheet_for(catalog: dict[str, CatalogDevice], device_name: str) -> CatalogDevice | None:
    """The entry whose `match` names this torch device name (torch.cuda.get_device_name), most specific
    match first; None when the model is unknown.

    A match names how the device name ends, in whole words and any case: "H100 PCIe" names "NVIDIA H100 PCIe"
    but not "NVIDIA H100 PCIe MIG 1g.10gb" (a slice is not the datasheet's device). Matches that fit one name
    all end it, so the longest is the most specific and wins: a user's entry matching "NVIDIA GeForce RTX
    4090" takes that name from the shipped "RTX 4090". No two entries share a match (load_catalog refuses
    it), so there are no ties.
    """
    best, best_len = None, 0
    for device in catalog.values():
        for text in device.match:
            if len(text.strip()) > best_len and _names_end(text, device_name):
                best, best_len = device, len(text.strip())
    return best


def _names_end(text: str, device_name: str) -> bool:
    # whole words: "L4" must not end "NVIDIA GL4"; nothing but the end of the name may follow
    pattern = r"(?<![0-9a-z])" + re.escape(text.strip()) + r"\Z"
    return re.search(pattern, device_name.strip(), re.IGNORECASE) is not None


@cache
def _shipped() -> tuple[Path, datetime.date | None, dict[str, dict[str, Any]]]:
    # parsed once a process; load_catalog copies what it changes, so the cached entries stay as shipped
    path = Path(str(resources.files(__package__) / CATALOG_FILE))
    when, entries = _read(path)
    for key, raw in entries.items():
        _device(path, key, raw, "")  # a broken shipped entry fails here, naming itself
    return path, when, entries


def _read(path: Path) -> tuple[datetime.date | None, dict[str, dict[str, Any]]]:
    """The file's date and its entries, by key (FileNotFoundError passes through: no file, no entries)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read the device catalog: {err}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    if raw is None:
        return None, {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a mapping with `devices:` (and an optional `date:`) is expected")
    unknown = sorted(str(k) for k in raw if k not in ("date", "devices"))
    if unknown:
        raise SpecError(f"{path}: {unknown[0]}: unknown key (a catalog has `date:` and `devices:`)")
    when = raw.get("date")
    if when is not None and not isinstance(when, datetime.date):
        raise SpecError(f"{path}: date: a date (YYYY-MM-DD) is expected, not {when!r}")
    devices = raw.get("devices") or {}
    if not isinstance(devices, dict):
        raise SpecError(f"{path}: devices: a mapping of key -> device is expected")
    entries = {}
    for key, entry in devices.items():
        key = str(key)
        if key == RESERVED:
            raise SpecError(f"{path}: devices.{key}: {RESERVED!r} is reserved: the local CPU is measured")
        if not _NAME.match(key):
            raise SpecError(f"{path}: devices.{key}: a key is lowercase letters, digits and '-'")
        if not isinstance(entry, dict):
            raise SpecError(f"{path}: devices.{key}: a mapping of fields is expected")
        entries[key] = entry
    return when, entries


def _merged(base: dict[str, Any], patch: dict[str, Any], path: Path) -> dict[str, Any]:
    """`patch` over `base`, field by field (tflops and sources precision by precision); the figures the patch
    sets take `path` as their source unless the patch names one."""
    merged = {**base, **patch}
    for field in ("tflops", "sources"):
        if isinstance(base.get(field), dict) and isinstance(patch.get(field), dict):
            merged[field] = {**base[field], **patch[field]}
    if "price" in patch and "usd_per_hour" not in patch:
        merged.pop("usd_per_hour", None)  # an owned device's cost replaces the shipped rent
    sources = merged.get("sources", {})
    if not isinstance(sources, dict):
        return merged  # validation says what is wrong with it
    sources, given = dict(sources), patch.get("sources") or {}
    changed = [f for f in FIGURES if f in patch and f != "tflops"]
    if isinstance(patch.get("tflops"), dict):
        changed += [f"tflops.{p}" for p in patch["tflops"]] if "tflops" in base else ["tflops"]
    if "price" in patch:
        changed.append("usd_per_hour")
    for field in changed:
        if field not in given:
            sources[field] = str(path)
    merged["sources"] = sources
    return merged


def _device(path: Path, key: str, raw: dict[str, Any], origin: str) -> CatalogDevice:
    try:
        entry = _Entry.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in (f"devices.{key}", *first["loc"]) if p != "[key]")
        raise SpecError(f"{path}: {where}: {first['msg'].removeprefix('Value error, ')}") from None
    return CatalogDevice(
        key=key,
        name=entry.name,
        kind=entry.kind,
        torch=entry.torch,
        memory_bytes=round(entry.memory_gb * 1e9),
        memory_bandwidth_gbs=entry.memory_bandwidth_gbs,
        tflops=dict(entry.tflops),
        watts=entry.watts,
        usd_per_hour=entry.hourly(),
        interconnect_gbs=entry.interconnect_gbs,
        host_link_gbs=entry.host_link_gbs,
        aliases=tuple(entry.aliases),
        match=tuple(entry.match),
        sources=dict(entry.sources),
        origin=origin,
    )


def _check_unique(devices: list[CatalogDevice], paths: dict[str, Path]) -> None:
    """An alias or a match string names one device: two would make resolve/datasheet_for guess."""
    seen_names: dict[str, str] = {device.key: device.key for device in devices}
    seen_matches: dict[str, str] = {}
    for device in devices:
        key = device.key
        for alias in device.aliases:
            other = seen_names.setdefault(alias, key)
            if other != key:
                raise SpecError(f"{paths[key]}: devices.{key}.aliases: {alias!r} already names {other}")
        for text in device.match:
            other = seen_matches.setdefault(text.strip().lower(), key)
            if other != key:
                raise SpecError(f"{paths[key]}: devices.{key}.match: {text!r} already names {other}")
