"""Errors a user can fix. The CLI prints them as one line and exits non-zero, with no traceback."""


class GpuforgeError(Exception):
    """Base of every error caused by the user's input or environment, not by a bug."""


class SpecError(GpuforgeError):
    """The job spec is malformed: the message names the field and the problem."""


class DataError(GpuforgeError):
    """A data file is missing, empty or lacks a column the job needs."""


class ModelError(GpuforgeError):
    """A model source cannot be resolved or built (missing dir, unknown arch, bad factory)."""


class RunDirError(GpuforgeError):
    """The run directory cannot be used (a file, or a run of another spec)."""


class TrainingFailed(GpuforgeError):
    """Training stopped on its own terms (NaN loss, budget); the run directory says why."""
