"""Read a data reference into records (list of dicts), raw text, or image arrays.

Files: .jsonl/.ndjson/.json, .csv/.tsv, .parquet, .txt/.md/.text, .npz.
Built in: sklearn:digits (8x8 handwritten digits, shipped by scikit-learn), stdlib:docstrings (the
docstrings of this Python's standard library: a real English/code corpus that every machine has).
"""

from __future__ import annotations

import ast
import csv
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuforge.errors import DataError

TEXT_SUFFIXES = {".txt", ".md", ".text"}
RECORD_SUFFIXES = {".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet"}


@dataclass
class Images:
    pixels: np.ndarray  # N x C x H x W, float32
    labels: np.ndarray  # N, int64


Source = list[dict[str, Any]] | str | Images  # records, raw text, or images


def read_source(ref: str, where: str, max_records: int | None = None) -> Source:
    """Read `ref` (a path or a built-in name); `where` names the spec field in errors."""
    if ref == "sklearn:digits":
        return _sklearn_digits(max_records)
    if ref == "stdlib:docstrings":
        return _stdlib_docstrings(max_records)
    if ref.partition(":")[0] in ("sklearn", "stdlib"):
        raise DataError(
            f"{where}: unknown built-in data set '{ref}' (known: sklearn:digits, stdlib:docstrings)"
        )
    path = Path(ref)
    if not path.exists():
        raise DataError(f"{where}: {path}: no such file")
    if path.is_dir():
        raise DataError(f"{where}: {path}: is a directory, expected a data file")
    suffix = path.suffix.lower()
    try:
        if suffix in TEXT_SUFFIXES:
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                raise DataError(f"{where}: {path}: is empty")
            return text
        if suffix == ".npz":
            return _npz(path, where, max_records)
        if suffix in RECORD_SUFFIXES:
            records = _records(path, suffix, where)
        else:
            raise DataError(
                f"{where}: {path}: unknown file type '{suffix}' "
                f"(use {', '.join(sorted(RECORD_SUFFIXES | TEXT_SUFFIXES | {'.npz'}))})"
            )
    except UnicodeDecodeError:
        raise DataError(f"{where}: {path}: not UTF-8 text") from None
    if max_records is not None:
        records = records[:max_records]
    if not records:
        raise DataError(f"{where}: {path}: holds no records")
    return records


def _records(path: Path, suffix: str, where: str) -> list[dict[str, Any]]:
    if suffix in (".jsonl", ".ndjson") or (suffix == ".json" and not path.read_text()[:1].strip() == "["):
        records = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: {path} line {number}: invalid JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: {path} line {number}: expected a JSON object")
                records.append(record)
        return records
    if suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: {path}: invalid JSON ({err.msg}, line {err.lineno})") from None
        if not all(isinstance(r, dict) for r in records):
            raise DataError(f"{where}: {path}: expected a list of JSON objects")
        return records
    if suffix in (".csv", ".tsv"):
        with path.open(encoding="utf-8-sig", newline="") as f:  # -sig: spreadsheets write a BOM
            try:
                return list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
            except csv.Error as err:
                raise DataError(f"{where}: {path}: malformed CSV ({err})") from None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{where}: {path}: not a readable parquet file ({err})") from None


def _npz(path: Path, where: str, max_records: int | None) -> Images:
    try:
        arrays = np.load(path)
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: {path}: not a readable .npz file ({err})") from None
    for x_key, y_key in (("x", "y"), ("images", "labels"), ("X", "y")):
        if x_key in arrays and y_key in arrays:
            x, y = arrays[x_key], arrays[y_key]
            break
    else:
        raise DataError(
            f"{where}: {path}: expected arrays 'x' and 'y' (or 'images' and 'labels'), "
            f"found {', '.join(arrays.files) or 'none'}"
        )
    if len(x) != len(y):
        raise DataError(f"{where}: {path}: {len(x)} images but {len(y)} labels")
    if len(x) == 0:
        raise DataError(f"{where}: {path}: holds no records")
    return _as_images(x[:max_records], y[:max_records], f"{where}: {path}")


def _as_images(x: np.ndarray, y: np.ndarray, where: str) -> Images:
    """N x H x W, N x C x H x W, or N x H x W x C (C in 1, 3, 4) -> float32 N x C x H x W."""
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise DataError(f"{where}: images must be N x H x W or N x C x H x W, got shape {x.shape}")
    if not np.issubdtype(np.asarray(y).dtype, np.integer):
        raise DataError(f"{where}: labels must be integers, got {np.asarray(y).dtype}")
    x = x.astype(np.float32)
    if x.max() > 1.0:
        x = x / x.max()
    return Images(np.ascontiguousarray(x), np.asarray(y, dtype=np.int64))


def _sklearn_digits(max_records: int | None) -> Images:
    table = _digits_table()
    if table is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images, target = digits.images, digits.target
    else:  # what load_digits() returns, read as it reads it
        images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int, copy=False)
    x = images[:max_records] / 16.0  # pixel intensities are 0..16
    return _as_images(x, target[:max_records], "sklearn:digits")


def _digits_table() -> np.ndarray | None:
    """scikit-learn's digits.csv.gz (64 pixels and the label a row) read without importing sklearn, which
    costs every process that trains on the digits more than a second of CPU; None where it is not there."""
    import gzip
    import importlib.util

    found = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    for folder in (found.submodule_search_locations or []) if found else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, mode="rt", encoding="utf-8") as f:
                return np.loadtxt(f, delimiter=",")
    return None


def _stdlib_docstrings(max_records: int | None) -> str:
    """Every module, class and function docstring of the standard library, in a stable order, cached."""
    from gpuforge.hardware.bench import cache_dir

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha1(f"{sys.version}|{stdlib}".encode()).hexdigest()[:12]
    cache = cache_dir() / f"stdlib-docstrings-{key}.txt"
    if cache.exists():
        text = cache.read_text(encoding="utf-8")
    else:
        pieces = []
        for path in sorted(stdlib.rglob("*.py")):
            rel = path.relative_to(stdlib).parts
            if rel[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 40:
                        pieces.append(doc.strip())
        text = "\n\n".join(pieces)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # whole or absent: the ranks of a distributed job build it at the same moment
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            partial.write_text(text, encoding="utf-8")
            os.replace(partial, cache)
        except OSError:
            pass
    if not text:
        raise DataError(f"data.train: stdlib:docstrings found no docstrings under {stdlib}")
    if max_records is not None:  # for raw text, a record is a paragraph
        text = "\n\n".join(text.split("\n\n")[:max_records])
    return text
