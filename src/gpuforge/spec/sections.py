"""The spec's sections as pydantic models, each field with its bounds and what it means.

The `compress:` section is in compress_bounds.py, beside the bounds `gpuforge compress` shares; the two
kinds of job that hold the sections are in jobs.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuforge.spec.units import parse_bytes, parse_duration

Task = Literal["sequence-classification", "causal-lm", "image-classification"]
TASKS = get_args(Task)
# the figures a task's evaluation reports, as metrics.jsonl names them (runtime/tasks.py EvalTally)
EVAL_METRICS = {
    "sequence-classification": ("eval_loss", "eval_accuracy"),
    "image-classification": ("eval_loss", "eval_accuracy"),
    "causal-lm": ("eval_loss", "eval_perplexity"),
}
MODEL_SCHEMES = ("bundled", "hf", "torchvision", "python")
DATA_SCHEMES = ("sklearn", "stdlib")  # built-in data sets; anything else is a file path


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def to_yaml(self, exclude_unset: bool = False) -> str:
        """The spec as YAML: every field, or (`exclude_unset`) only those its writer set, so that whoever
        reads it fills in the rest with its own defaults (a server: its prices)."""
        return yaml.safe_dump(self.model_dump(mode="json", exclude_unset=exclude_unset), sort_keys=False)


class ModelSpec(Section):
    source: str = Field(
        description="bundled:<name> | hf:<local dir> | torchvision:<arch> | python:<module>:<fn>"
    )
    task: Task
    num_labels: int | None = Field(None, ge=2, description="inferred from the data when absent")
    pretrained: bool | None = Field(None, description="load the source's weights (default where it has them)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the builder")

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        scheme, sep, rest = v.partition(":")
        if not sep or not rest:
            raise ValueError(
                f"'{v}' must look like <scheme>:<name>, scheme one of {', '.join(MODEL_SCHEMES)}"
            )
        if scheme not in MODEL_SCHEMES:
            raise ValueError(f"unknown scheme '{scheme}' (known: {', '.join(MODEL_SCHEMES)})")
        if scheme == "python" and rest.count(":") != 1:
            raise ValueError(f"'{v}' must be python:<module or file.py>:<function>")
        return v


class DataSpec(Section):
    train: str = Field(description="a jsonl/csv/parquet/txt/npz file, or sklearn:digits, stdlib:docstrings")
    eval: str | None = Field(
        None, description="held-out file; when absent, eval_fraction of train is held out"
    )
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    text_field: str = "text"
    label_field: str = "label"
    max_length: int = Field(128, ge=4, le=65536)
    tokenizer: str | None = Field(
        None, description="bytes | hf:<dir> | bundled:<name>; defaults to the model's own tokenizer"
    )
    max_records: int | None = Field(None, ge=1, description="read at most this many records (quick trials)")
    group_by_length: bool = Field(
        False,
        description="text classification: batches of examples of similar length (seeded, still shuffled), "
        "so that per-batch padding pads little; changes which examples share a batch",
    )


MAX_PROFILE_STEPS = 50  # a profile's steps at most: a trace of more is hundreds of MB and tells no more


class ProfileSpec(Section):
    start_step: int = Field(10, ge=1, description="the first step recorded (after warm-up: 10 by default)")
    steps: int = Field(5, ge=1, le=MAX_PROFILE_STEPS, description="steps recorded, from start_step on")
    stacks: bool = Field(
        False,
        description="Python call stacks in the trace too: slower recorded steps, and the host work between "
        "phases (`other`) grows with them",
    )


class EarlyStopSpec(Section):
    """Stop a job whose evaluations stop improving (train.eval_every sets how often they come)."""

    metric: str = Field(
        "eval_loss",
        description="an evaluation's figure as metrics.jsonl names it: eval_loss, eval_accuracy "
        "(classification), eval_perplexity (causal-lm)",
    )
    patience: int = Field(
        3, ge=1, le=10_000, description="evaluations in a row without improvement before the job stops"
    )
    min_delta: float = Field(
        0.0, ge=0, description="an improvement is a change past the best by more than this"
    )
    direction: Literal["minimize", "maximize"] | None = Field(
        None, description="default: minimize a metric named *loss* or *perplexity*, maximize any other"
    )


class TrainSpec(Section):
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    batch_size: int | Literal["auto"] = Field(
        32, description="examples a forward; the step's batch too, unless global_batch_size"
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="examples a step, over all processes, reached by gradient accumulation"
    )
    lr: float | Literal["auto"] = Field(
        5e-5,
        description="AdamW's peak rate, or auto: a range test of 16 steps at the start picks it "
        "(train/lr_find.py: the rule, <run>/lr_find.json: the curve); its time and cost count in the run's",
    )
    weight_decay: float = Field(0.01, ge=0)
    schedule: Literal["auto", "cosine", "wsd", "constant"] = Field(
        "auto",
        description="after warm-up: cosine decays to lr * min_lr_ratio over max_steps; wsd holds lr, then "
        "decays in the last 20% of max_steps; constant holds it. auto: wsd when stop_at or early_stop may "
        "end the run before max_steps (a ceiling then, not a length), else cosine",
    )
    warmup_steps: int | None = Field(None, ge=0, description="default: warmup_ratio's, else by what trains")
    warmup_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="default by what trains: none for LoRA and for a model trained from scratch; 5% of "
        "the steps (at most 100) for full fine-tuning of pretrained weights",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine and wsd decay to lr * min_lr_ratio")
    grad_clip: float | None = Field(1.0, gt=0)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    seed: int = Field(0, ge=0, lt=2**32)
    log_every: int = Field(1, ge=1)
    eval_every: int | None = Field(None, ge=1, description="default: only at the end")
    eval_max_examples: int | None = Field(
        None,
        ge=1,
        description="evaluations before the last read a fixed seeded sample of this many held-out examples "
        "(enough for stop_at and early_stop); the last evaluation reads the whole set",
    )
    checkpoint_every: int | None = Field(None, ge=1, description="default: only at the end and on signals")
    keep_checkpoints: int = Field(2, ge=1)
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward: less memory")
    compile: bool = Field(False, description="torch.compile the model (first steps pay the compile time)")
    fast_dropout: bool = Field(
        True, description="CPU: dropout masks from a faster generator, seeded from torch's (same expectation)"
    )
    profile: ProfileSpec | None = Field(
        None, description="record these steps with torch.profiler into <run>/profile/ (gpuforge profile RUN)"
    )
    early_stop: EarlyStopSpec | None = Field(
        None,
        description="end the job (finished, with the reason) once early_stop.metric has not improved for "
        "early_stop.patience evaluations; needs eval_every",
    )
    stop_at: dict[str, float] | None = Field(
        None,
        max_length=8,
        description="{metric: threshold}, e.g. {eval_accuracy: 0.9}: end the job (finished) at the first "
        "evaluation where ANY metric reaches its threshold (<= for *loss*/*perplexity*, >= for others); "
        "needs eval_every",
    )
    keep_best: bool = Field(
        False,
        description="the job's model is the best evaluation's weights (by early_stop.metric, else "
        "eval_loss), not the last step's; needs eval_every",
    )

    @field_validator("lr")
    @classmethod
    def _lr(cls, v: float | str) -> float | str:
        if v != "auto" and not v > 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, v: int | str) -> int | str:
        if v != "auto" and v < 1:
            raise ValueError("must be >= 1")
        return v

    @model_validator(mode="after")
    def _global_batch(self) -> TrainSpec:
        if self.batch_size == "auto" and self.global_batch_size is None:
            raise ValueError(
                "global_batch_size is required with batch_size: auto, so that the batch the "
                "optimizer sees does not depend on the machine"
            )
        if self.global_batch_size is not None and isinstance(self.batch_size, int):
            if self.global_batch_size % self.batch_size:
                raise ValueError(
                    f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                    f"batch_size ({self.batch_size})"
                )
        return self


class LoraSpec(Section):
    r: int = Field(8, ge=1)
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(
        None, description="name patterns (fnmatch); default: attention query/value of known families"
    )
    modules_to_save: list[str] | None = Field(
        None, description="modules trained in full beside LoRA (a classification head is added for you)"
    )


class AdaptSpec(Section):
    lora: LoraSpec | None = None
    quantize_base: Literal["nf4", "int8"] | None = None

    @model_validator(mode="after")
    def _quantized_base_needs_lora(self) -> AdaptSpec:
        if self.quantize_base is not None and self.lora is None:
            raise ValueError("quantize_base needs lora (the quantized base is frozen; LoRA is what trains)")
        return self


LabelText = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-/]+$")]


SHARE_STEP = 0.05  # a fraction of a device is a multiple of this: 0.05 .. 0.95


class ResourcesSpec(Section):
    devices: int | float = Field(
        1,
        gt=0,
        description="whole devices (one process each), or a fraction of one below 1, e.g. 0.5 or 0.25: the "
        "job shares a device (a share of a CPU slot's cores, pinned; a GPU's memory, capped)",
    )
    device_type: Literal["auto", "cuda", "mps", "cpu"] = "auto"
    max_memory: str | None = Field(
        None, description="memory budget, e.g. 8GiB: the batch search's; plan and train refuse a job over it"
    )
    max_time: str | None = Field(
        None,
        description="wall time at most, e.g. 90m or 2h (server): stopped at a checkpoint past it (paused), "
        "and what backfill trusts",
    )
    preemptible: bool = Field(
        True, description="false: never stopped for a job of higher priority (server; admin keys only)"
    )
    placement: dict[LabelText, LabelText] = Field(
        default_factory=dict,
        description="labels its devices must carry, e.g. {site: onprem} (server; labels: gpuforge devices)",
        max_length=16,
    )

    @field_validator("devices")
    @classmethod
    def _whole_or_fraction(cls, v: int | float) -> int | float:
        if v >= 1:
            if v != int(v):
                raise ValueError(f"{v}: whole devices (1, 2, ...) or a fraction of one below 1 (0.5, 0.25)")
            return int(v)
        steps = round(v / SHARE_STEP)
        if steps < 1 or abs(steps * SHARE_STEP - v) > 1e-9:
            raise ValueError(f"{v}: a fraction of a device is a multiple of {SHARE_STEP} (0.05 .. 0.95)")
        return round(steps * SHARE_STEP, 2)

    @property
    def processes(self) -> int:
        """Processes (one a device) it runs: its devices, or 1 for a fraction of one."""
        return int(self.devices) if self.devices >= 1 else 1

    @property
    def share(self) -> float | None:
        """The fraction of one device it holds; None for whole devices."""
        return float(self.devices) if self.devices < 1 else None

    @field_validator("max_memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v

    @field_validator("max_time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None:
            parse_duration(v)
        return v

    @property
    def max_time_s(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time)


class DistributedSpec(Section):
    """One job over several processes (one a device): torchrun's elastic launcher, gloo or NCCL.

    The global batch of a step is the same whatever the number of processes (each takes its slice of it),
    so the loss curve does not depend on it and a checkpoint written by N processes resumes with M."""

    strategy: Literal["none", "ddp", "fsdp"] = Field(
        "none", description="ddp: a replica a process; fsdp: parameters and optimizer state sharded"
    )
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="what DDP all-reduces (ddp only)"
    )
    powersgd_rank: int = Field(4, ge=1, le=256, description="rank of PowerSGD's low-rank approximation")
    powersgd_start_step: int = Field(
        0, ge=0, description="plain all-reduce for the first steps, PowerSGD after"
    )
    max_restarts: int = Field(
        3, ge=0, le=100, description="restarts from the last checkpoint when a process dies"
    )
    timeout_s: float = Field(
        300.0, gt=0, le=86400, description="a collective waiting longer fails the job (then it restarts)"
    )


class CostSpec(Section):
    usd_per_hour: float = Field(0.0, ge=0, description="what the device costs; 0 means not tracked")
    instance: str | None = None
    budget_usd: float | None = Field(None, gt=0, description="pause (with a checkpoint) once spent")


class MlflowSpec(Section):
    uri: str = Field(
        min_length=1,
        description="tracking URI: a file store (file:<dir> or a plain path), sqlite:///<file> or http(s)://",
    )
    experiment: str = Field("gpuforge", min_length=1, max_length=500)


class TrackingSpec(Section):
    """Where the metrics go besides metrics.jsonl (needs `pip install 'gpuforge[tracking]'`)."""

    tensorboard: bool = Field(False, description="event files in <run>/tensorboard/")
    mlflow: MlflowSpec | None = Field(
        None, description="params, metrics, the summary and the model to an MLflow run named after the job"
    )


EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
SCRIPT_ENV_RESERVED = ("GPUFORGE_", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH")
# what isolates a fraction of a GPU (scheduler/sharing.py): a script may not lift its own cap or MPS share
SCRIPT_ENV_RESERVED_PREFIXES = ("GPUFORGE_", "CUDA_MPS_", "CUDA_DEVICE_MEMORY_")


class ScriptSpec(Section):
    command: str = Field(
        min_length=1,
        max_length=4000,
        description="run in the job's working copy, no shell; a leading `python` is gpuforge's interpreter "
        "(or script.python)",
    )
    files: list[str] = Field(
        default_factory=list,
        max_length=1000,
        description="files and folders the command needs, relative to the spec (submit sends them)",
    )
    env: dict[EnvName, Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict, max_length=64)
    launcher: Literal["none", "torchrun"] = Field(
        "none", description="torchrun: one process per device, rendezvous set up"
    )
    python: str | None = Field(None, description="another interpreter for a leading `python` (a venv's)")
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="starts again after a signal gpuforge did not send kills it (OOM, a segfault)",
    )
    # under the server's own grace for a runner it cancels (scheduler/executor.py: 30 s)
    stop_grace_s: float = Field(
        20.0, ge=1, le=25, description="after SIGTERM, this long to save, then SIGKILL"
    )
    workdir: str = Field(
        "",
        description="the job's working copy: the spec's folder (set when loaded); empty on a server: "
        "<run dir>.work, made from the files sent",
    )

    @field_validator("env")
    @classmethod
    def _not_ours(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if name.startswith(SCRIPT_ENV_RESERVED_PREFIXES) or name in SCRIPT_ENV_RESERVED[1:]:
                raise ValueError(f"{name}: gpuforge sets this one itself")
        return v

    @field_validator("files")
    @classmethod
    def _relative(cls, v: list[str]) -> list[str]:
        for f in v:
            if not f or Path(f).is_absolute() or ".." in Path(f).parts:
                raise ValueError(f"{f!r}: a path inside the job's folder (relative, no '..')")
        return v
