"""Data: read records (sources), turn them into tensors for a task (text, images), batch them (batches)."""

from gpuforge.data.prepare import PreparedData, prepare_data

__all__ = ["PreparedData", "prepare_data"]
