"""Third-party chatter off by default, back with `gpuforge --verbose` or GPUFORGE_VERBOSE=1.

The libraries a model load pulls in talk on their own: torchao and bitsandbytes log that optional kernels
did not load, torch logs deprecations of what torchao registers, transformers warns about its own API and
draws tqdm bars while it reads and writes weights. None of it is about the user's job, and it lands in
every run's log. Much of it is said at import time, so `quiet_third_party` runs before any of those
libraries is imported (the CLI's entry point); it only sets switches those libraries read later.
"""

from __future__ import annotations

import logging
import os
import warnings

# read by the libraries when they are imported or draw a bar; a value the user set stays
QUIET_ENV = {
    "TQDM_DISABLE": "1",  # every tqdm bar (transformers' "Loading weights", "Writing model shards")
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",  # transformers resets its logger's level from this on import
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_VERBOSITY": "error",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # mlflow sets its logger's level from this on import (tracking:)
    "MLFLOW_DISABLE_TELEMETRY": "true",  # mlflow 3 reports usage to its makers unless told not to
    "DO_NOT_TRACK": "true",
}
# loggers of the libraries gpuforge loads; their errors still show
THIRD_PARTY_LOGGERS = (
    "torchao",
    "bitsandbytes",
    "torch.utils._pytree",  # torch's own handler prints it, so its child logger, not the root, is set
    "transformers",
    "huggingface_hub",
    "peft",
    "accelerate",
    "sentence_transformers",
    "kernels",  # Hugging Face's kernel hub, which transformers asks for bitsandbytes' kernels (offline here)
)


def verbose() -> bool:
    """Whether the user asked to see third-party output (GPUFORGE_VERBOSE=1; --verbose sets it)."""
    from gpuforge.settings import current  # here: pydantic is no cost a verb should pay at start-up

    return current().verbose


def quiet_third_party() -> None:
    """Silence third-party warnings, log lines below ERROR and progress bars in this process (and in the
    children that inherit its environment); gpuforge's own logger is left as it is."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.simplefilter("ignore")  # gpuforge itself does not use warnings; what comes is theirs
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
