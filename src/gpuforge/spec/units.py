"""The units a spec writes its sizes and times in: memory sizes (`8GiB`) and durations (`1h30m`)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'8GiB' -> 8589934592; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a memory size (e.g. 512MiB, 8GiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_DURATION = re.compile(
    r"\s*(?:([0-9]*\.?[0-9]+)\s*d)?\s*(?:([0-9]*\.?[0-9]+)\s*h)?\s*"
    r"(?:([0-9]*\.?[0-9]+)\s*m)?\s*(?:([0-9]*\.?[0-9]+)\s*s?)?\s*"
)


def parse_duration(text: str | float) -> float:
    """'90m' -> 5400.0, '1h30m' -> 5400.0, '45s' or 45 -> 45.0: seconds, more than 0."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = _DURATION.fullmatch(str(text))
        if not m or not any(m.groups()):
            raise ValueError(f"'{text}' is not a duration (e.g. 45s, 90m, 2h, 1h30m, 1d)")
        days, hours, minutes, secs = (float(g) if g else 0.0 for g in m.groups())
        seconds = days * 86400 + hours * 3600 + minutes * 60 + secs
    if not 0 < seconds <= 366 * 86400:
        raise ValueError(f"'{text}': a duration must be more than 0 and at most a year")
    return seconds
