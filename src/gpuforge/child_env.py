"""The environment a child of the server gets: an allow-list, never the server's whole environment.

Job runners, their ranks (local or Ray actors) and deployment replicas run code that a non-admin key
chose the inputs of; what they inherit they can read. So they get the variables a Python/PyTorch process
needs to run (paths, locale, threads, CUDA/NCCL/gloo tuning, offline switches) and the gpuforge settings
the runner reads, and never the admin key, the store's URL or any other secret the server holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

PASSED = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
        "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
        "CONDA_PREFIX", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH",
        "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY", "TOKENIZERS_PARALLELISM", "XDG_CACHE_HOME", "PYTORCH_CUDA_ALLOC_CONF",
        "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
        # the gpuforge settings a runner or a replica reads (the server's own, like GPUFORGE_DB, stay)
        "GPUFORGE_CACHE_DIR", "GPUFORGE_CPU_SLOTS", "GPUFORGE_EXECUTOR", "GPUFORGE_RAY_ADDRESS",
        "GPUFORGE_SLURM_PARTITION", "GPUFORGE_SLURM_ACCOUNT", "GPUFORGE_SLURM_QOS",
        "SLURM_CONF",  # where Slurm's commands find the cluster (not the SLURM_JOB_* of a server in a job)
        "GPUFORGE_ATTEMPT", "GPUFORGE_RESTART", "GPUFORGE_USER_CODE", "GPUFORGE_CONFINE_ROOTS",
        "GPUFORGE_CONFINE_EXCLUDED",
        "GPUFORGE_PUBLIC_METRICS", "GPUFORGE_VERBOSE",
    }
)  # fmt: skip
PASSED_PREFIXES = ("LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "CUBLAS_")
# even under an allowed prefix: a name that says it holds a secret is not passed
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def passed(name: str) -> bool:
    """Whether a variable of the server's goes to its children: one named in PASSED, or one under a passed
    prefix whose name does not say it holds a secret."""
    if name in PASSED:
        return True
    return name.startswith(PASSED_PREFIXES) and not SECRET_NAME.search(name)


def child_environment(extra: Mapping[str, str] = (), base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) cut to the allow-list, then `extra` (what the caller
    gives this child on purpose, e.g. its devices or a replica's own key) on top."""
    base = os.environ if base is None else base
    return {k: v for k, v in base.items() if passed(k)} | dict(extra)
