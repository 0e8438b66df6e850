"""A cheap look at a data file before a job is queued: do the columns the spec names exist?

The server asks this at submit (routes/jobs.py), so a misspelt `data.label_field` is a 422 there rather
than a job that starts and fails. Only the first record is read (the CSV header, the first JSON line, a
parquet file's schema): a file of any size costs the same. What it cannot tell here (a bad line further
down, an empty file) the runner still finds, with the same messages as data/prepare.py.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from gpuforge.data.sources import RECORD_SUFFIXES
from gpuforge.errors import DataError
from gpuforge.spec import DATA_SCHEMES, JobSpec

FIRST_RECORD_BYTES = 1 << 20  # a first JSON record longer than this is left for the runner to read


def check_columns(spec: JobSpec) -> None:
    """A DataError naming the field when a data file the spec names is missing or lacks a column its
    task reads (text and label for classification, text for causal-lm)."""
    settings = {"sequence-classification": ("text_field", "label_field"), "causal-lm": ("text_field",)}
    wanted = settings.get(spec.model.task, ())
    for where, ref in (("data.train", spec.data.train), ("data.eval", spec.data.eval)):
        if not ref or ref.partition(":")[0] in DATA_SCHEMES:
            continue
        path = Path(ref)
        if not path.exists():
            raise DataError(f"{where}: {path}: no such file")
        columns = first_columns(path)
        if columns is None:  # not records (text, images), or unreadable here: the runner says which
            continue
        for setting in wanted:
            field = getattr(spec.data, setting)
            if field not in columns:
                shown = ", ".join(map(str, columns))
                raise DataError(f"data.{setting}: '{field}' not found in {ref} (columns: {shown})")


def first_columns(path: Path) -> list[str] | None:
    """The keys of the file's first record, or None when it holds no records or cannot be read cheaply."""
    suffix = path.suffix.lower()
    if suffix not in RECORD_SUFFIXES or not path.is_file():
        return None
    try:
        if suffix in (".csv", ".tsv"):
            with path.open(encoding="utf-8-sig", newline="") as f:  # as sources.py reads it
                return next(csv.reader(f, delimiter="\t" if suffix == ".tsv" else ","), None)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        return _first_json_record(path)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return None


def _first_json_record(path: Path) -> list[str] | None:
    with path.open(encoding="utf-8") as f:
        head = f.read(FIRST_RECORD_BYTES)
    text = head.lstrip()
    if text.startswith("["):  # a .json list of objects: decode its first element only
        text = text[1:].lstrip()
    else:  # JSON lines: the first non-blank line
        text = next((line for line in text.splitlines() if line.strip()), "")
    record, _ = json.JSONDecoder().raw_decode(text)
    return list(record) if isinstance(record, dict) else None
