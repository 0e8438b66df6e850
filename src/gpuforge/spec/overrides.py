"""`--set a.b.c=value`: one value of the raw spec replaced before it is validated."""

from __future__ import annotations

from typing import Any

import yaml

from gpuforge.errors import SpecError


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `--set a.b.c=value` to the raw spec; the value is parsed as YAML (3, 1e-3, true)."""
    key, sep, value_text = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise SpecError(f"--set {assignment}: expected key.path=value, e.g. train.lr=1e-3")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        value = value_text
    set_key(raw, key, value, f"--set {assignment}")


def set_key(raw: dict[str, Any], key: str, value: Any, told_as: str | None = None) -> None:
    """Set the dotted `key` of the raw spec to `value`, making the sections on the way."""
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"{told_as or key}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value
