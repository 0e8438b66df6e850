"""A spec's relative paths (data files, `hf:` dirs, `python:` files, a local MLflow store) made absolute
against the spec file's directory, so that a spec and its data travel together."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from gpuforge.spec.sections import DATA_SCHEMES


def mlflow_local_path(uri: str) -> str | None:
    """What an MLflow tracking URI writes on this machine: a file store's directory (`file:` or a plain
    path) or an SQLite database (`sqlite:///`); None for anything else (a server)."""
    scheme = urlparse(uri).scheme
    if not scheme:
        return uri
    if scheme == "file":
        return unquote(urlparse(uri).path)
    if scheme == "sqlite" and uri.startswith("sqlite:///"):
        return uri[len("sqlite:///") :]
    return None


def _resolve_tracking_uri(uri: str, base: Path) -> str:
    """A file store's or SQLite database's relative path made absolute, like the spec's other paths."""
    path = mlflow_local_path(uri)
    if not path or Path(path).is_absolute():  # a server, or absolute already
        return uri
    resolved, scheme = _resolve_path(path, base), urlparse(uri).scheme
    return Path(resolved).as_uri() if scheme == "file" else f"sqlite:///{resolved}" if scheme else resolved


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve_paths(raw: dict[str, Any], base: Path) -> None:
    """Make file references absolute, relative to the spec's directory."""
    data = raw.get("data")
    if isinstance(data, dict):
        for key in ("train", "eval"):
            v = data.get(key)
            if isinstance(v, str) and v.partition(":")[0] not in DATA_SCHEMES:
                data[key] = _resolve_path(v, base)
        tok = data.get("tokenizer")
        if isinstance(tok, str) and tok.startswith("hf:"):
            data["tokenizer"] = "hf:" + _resolve_path(tok[3:], base)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("source"), str):
        scheme, _, rest = model["source"].partition(":")
        if scheme == "hf" and rest:
            model["source"] = "hf:" + _resolve_path(rest, base)
        elif scheme == "python" and rest.count(":") == 1:
            module, fn = rest.split(":")
            if module.endswith(".py"):
                model["source"] = f"python:{_resolve_path(module, base)}:{fn}"
    mlflow = raw["tracking"].get("mlflow") if isinstance(raw.get("tracking"), dict) else None
    if isinstance(mlflow, dict) and isinstance(mlflow.get("uri"), str):
        mlflow["uri"] = _resolve_tracking_uri(mlflow["uri"], base)
