"""Comparing runs: the spec keys that differ between them, and their final figures side by side."""

from __future__ import annotations

from typing import Any

from gpuforge.store.ingest import in_users_names

MAX_COMPARED = 8  # curves beyond this many overlaid are no longer readable
FINAL_FIGURES = ("final_loss", "samples_per_s", "mfu", "cost_usd", "wall_s")


def parse_ids(text: str) -> list[int]:
    """`3,5,8` as ids: 2 to MAX_COMPARED distinct positive integers, in the order given; a ValueError
    that names what is wrong otherwise."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 0 < int(part) < 2**31:
            raise ValueError(f"ids: {part!r} is not a job id (ids=3,5,8)")
        if int(part) not in ids:
            ids.append(int(part))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise ValueError(f"ids: {len(ids)} distinct jobs named; compare takes 2 to {MAX_COMPARED}")
    return ids


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested spec as dotted keys: {"train": {"lr": 0.01}} -> {"train.lr": 0.01}; lists stay values."""
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def in_users_spec(value: Any, files: dict[str, str] | None) -> Any:
    """A spec with each uploaded file's server path (<home>/uploads/<sha256>.py) in the name the user's
    client gave it (a job's `files`): what a person reads, not a hash."""
    if isinstance(value, dict):
        return {key: in_users_spec(inner, files) for key, inner in value.items()}
    if isinstance(value, list):
        return [in_users_spec(inner, files) for inner in value]
    return in_users_names(value, files) if isinstance(value, str) and files else value


def spec_diff(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The keys whose values are not the same in every spec (absent counts as null), in the order they
    first appear, each with one value a spec."""
    flats = [flatten(spec) for spec in specs]
    keys = list(dict.fromkeys(key for flat in flats for key in flat))
    rows = []
    for key in keys:
        values = [flat.get(key) for flat in flats]
        if any(v != values[0] for v in values[1:]):
            rows.append({"key": key, "values": values})
    return rows


def finals(job_id: int, summary: dict[str, Any] | None, latest: dict[str, Any]) -> dict[str, Any]:
    """A run's final figures: from its summary when it has one, else its latest logged figures."""
    summary = summary or {}
    figures = {name: summary.get(name, latest.get(name)) for name in FINAL_FIGURES}
    if figures["final_loss"] is None:
        figures["final_loss"] = latest.get("loss")
    return {"id": job_id, "status": summary.get("status"), "eval": summary.get("eval") or {}, **figures}
