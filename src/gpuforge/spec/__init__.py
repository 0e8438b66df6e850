"""The job spec: typed sections, YAML loading, `--set key=value` overrides and errors that name the field.

A spec is YAML validated by pydantic. Unknown keys are errors. Relative paths (data files, `hf:` model
dirs, `python:` files) are resolved against the spec file's directory, so a spec and its data travel
together; the resolved spec (defaults filled in, paths absolute) is what a run directory stores.

The package by concern: `sections` (the sections' models), `compress_bounds` (the `compress:` section and
the bounds `gpuforge compress` shares), `jobs` (the two kinds of job), `units` (sizes, durations), `paths`
(relative paths made absolute), `overrides` (`--set`), `tune` (a search's `tune:` section), `problems`
(error wording and suggestions),
`script_files` (a script job's working copy) and `load` (file -> spec). Import from `gpuforge.spec`.
"""

from gpuforge.spec.compress_bounds import (
    CompressSpec,
    PruneSpec,
    PruneStructure,
    QuantKind,
    RecoverSteps,
    Sparsity,
    check_sparsity,
    pruning_problem,
)
from gpuforge.spec.jobs import JobSpec, ScriptJobSpec
from gpuforge.spec.load import load_spec, load_train_spec, parse_spec
from gpuforge.spec.overrides import apply_override, set_key
from gpuforge.spec.paths import mlflow_local_path
from gpuforge.spec.problems import (
    ALIASES,
    MAX_PROBLEMS,
    format_validation_error,
    problem_paths,
    suggest_key,
    validation_problems,
)
from gpuforge.spec.script_files import MAX_SCRIPT_FILES, working_copy_files
from gpuforge.spec.sections import (
    DATA_SCHEMES,
    EVAL_METRICS,
    MAX_PROFILE_STEPS,
    MODEL_SCHEMES,
    SCRIPT_ENV_RESERVED,
    TASKS,
    AdaptSpec,
    CostSpec,
    DataSpec,
    DistributedSpec,
    EarlyStopSpec,
    EnvName,
    LabelText,
    LoraSpec,
    MlflowSpec,
    ModelSpec,
    ProfileSpec,
    ResourcesSpec,
    ScriptSpec,
    Section,
    Task,
    TrackingSpec,
    TrainSpec,
)
from gpuforge.spec.tune import SearchSpec, TuneSpec, check_search, load_search, parse_tune
from gpuforge.spec.units import parse_bytes, parse_duration

__all__ = [
    "ALIASES",
    "DATA_SCHEMES",
    "EVAL_METRICS",
    "MAX_PROBLEMS",
    "MAX_PROFILE_STEPS",
    "MAX_SCRIPT_FILES",
    "MODEL_SCHEMES",
    "SCRIPT_ENV_RESERVED",
    "TASKS",
    "AdaptSpec",
    "CompressSpec",
    "CostSpec",
    "DataSpec",
    "DistributedSpec",
    "EarlyStopSpec",
    "EnvName",
    "JobSpec",
    "LabelText",
    "LoraSpec",
    "MlflowSpec",
    "ModelSpec",
    "ProfileSpec",
    "PruneSpec",
    "PruneStructure",
    "QuantKind",
    "RecoverSteps",
    "ResourcesSpec",
    "ScriptJobSpec",
    "ScriptSpec",
    "SearchSpec",
    "Section",
    "Sparsity",
    "Task",
    "TrackingSpec",
    "TrainSpec",
    "TuneSpec",
    "apply_override",
    "check_search",
    "check_sparsity",
    "format_validation_error",
    "load_search",
    "load_spec",
    "load_train_spec",
    "mlflow_local_path",
    "parse_bytes",
    "parse_duration",
    "parse_spec",
    "parse_tune",
    "problem_paths",
    "set_key",
    "pruning_problem",
    "suggest_key",
    "validation_problems",
    "working_copy_files",
]
