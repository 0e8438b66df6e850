"""Data: read records (sources), turn them into tensors for a task (text, images), batch them (batches).

`prepare_data` is imported on first use: it brings torch, and the server's cheap checks (columns.py)
import this package without needing it."""

from __future__ import annotations

__all__ = ["PreparedData", "prepare_data"]


def __getattr__(name: str):
    if name in __all__:
        from gpuforge.data import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module 'gpuforge.data' has no attribute {name!r}")
