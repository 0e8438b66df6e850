"""The job spec: typed sections, YAML loading, `--set key=value` overrides and errors that name the field.

A spec is YAML validated by pydantic. Unknown keys are errors. Relative paths (data files, `hf:` model
dirs, `python:` files) are resolved against the spec file's directory, so a spec and its data travel
together; the resolved spec (defaults filled in, paths absolute) is what a run directory stores.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import unquote, urlparse

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuforge.errors import SpecError

Task = Literal["sequence-classification", "causal-lm", "image-classification"]
TASKS = get_args(Task)
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


MAX_PROFILE_STEPS = 50  # a profile's steps at most: a trace of more is hundreds of MB and tells no more


class ProfileSpec(Section):
    start_step: int = Field(10, ge=1, description="the first step recorded (after warm-up: 10 by default)")
    steps: int = Field(5, ge=1, le=MAX_PROFILE_STEPS, description="steps recorded, from start_step on")
    stacks: bool = Field(
        False,
        description="Python call stacks in the trace too: slower recorded steps, and the host work between "
        "phases (`other`) grows with them",
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
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int | None = Field(None, ge=0, description="default: warmup_ratio of the steps")
    warmup_ratio: float = Field(0.05, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decays to lr * min_lr_ratio")
    grad_clip: float | None = Field(1.0, gt=0)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    seed: int = Field(0, ge=0, lt=2**32)
    log_every: int = Field(1, ge=1)
    eval_every: int | None = Field(None, ge=1, description="default: only at the end")
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


# The bounds of the compression options, written once: the `compress:` section below and `gpuforge compress`
# (compress/options.py, whose fields have these types) refuse the same requests, each naming its own field.
PruneStructure = Literal["unstructured", "2:4", "channel"]
QuantKind = Literal["int8", "int4", "int8-dynamic"]


def check_sparsity(amount: float) -> float:
    """A share of weights (or channels) to remove: all of them would leave no layer."""
    if not 0.0 <= amount < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {amount}")
    return amount


Sparsity = Annotated[float, AfterValidator(check_sparsity)]
RecoverSteps = Annotated[int, Field(ge=0)]


def pruning_problem(
    amount: float, structure: str, recover_steps: int, named: Callable[[str], str]
) -> str | None:
    """What is wrong with these pruning settings together, or None. `named` gives the name the user wrote
    for each (by its compress/options.py field): `--prune` on the command line, `amount` in a spec."""
    if structure == "2:4" and amount not in (0.0, 0.5):
        return f"{named('prune_structure')} 2:4 removes exactly half: {named('prune')} {amount} does not fit"
    if recover_steps and not amount:
        return f"{named('recover_steps')} fine-tunes after pruning: it needs {named('prune')} > 0"
    return None


class PruneSpec(Section):
    amount: Sparsity = Field(0.5, description="share of weights (or FFN/conv channels) removed")
    structure: PruneStructure = "unstructured"
    recover_steps: RecoverSteps = Field(0, description="fine-tune steps after pruning, masks kept")

    @model_validator(mode="after")
    def _settings_fit_together(self) -> PruneSpec:
        names = {"prune": "amount", "prune_structure": "structure", "recover_steps": "recover_steps"}
        if problem := pruning_problem(self.amount, self.structure, self.recover_steps, names.__getitem__):
            raise ValueError(problem)
        return self


class CompressSpec(Section):
    """Run after training on <run>/model; the result goes to <run>/compressed (gpuforge compress)."""

    merge: bool = Field(False, description="fold the LoRA adapter into its base")
    prune: PruneSpec | None = None
    quantize: QuantKind | None = None
    sweep: bool = Field(False, description="every useful combination, with the Pareto front")
    onnx: bool = Field(
        False,
        description="the ONNX exports too (fp32, int8; gpuforge[export]) in <run>/compressed/onnx-*",
    )

    @property
    def requested(self) -> bool:
        return self.merge or self.prune is not None or self.quantize is not None or self.sweep or self.onnx

    @model_validator(mode="after")
    def _onnx_beside(self) -> CompressSpec:
        single = self.merge or self.prune is not None or self.quantize is not None
        if self.onnx and single and not self.sweep:
            raise ValueError(
                "onnx: true goes with sweep: true or alone, not with merge, prune or quantize (a single "
                "variant fills <run>/compressed itself)"
            )
        return self


LabelText = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-/]+$")]


class ResourcesSpec(Section):
    devices: int = Field(1, ge=1)
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


class JobSpec(Section):
    name: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)
    # never written out: specs stored before kinds existed resume, and older servers read what clients send
    kind: Literal["train"] = Field(
        "train", description="train: gpuforge's engine; script: your command", exclude=True
    )
    model: ModelSpec
    data: DataSpec
    train: TrainSpec = Field(default_factory=TrainSpec)
    adapt: AdaptSpec = Field(default_factory=AdaptSpec)
    compress: CompressSpec = Field(default_factory=CompressSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first (server)")

    @model_validator(mode="after")
    def _processes(self) -> JobSpec:
        devices, dist = self.resources.devices, self.distributed
        if devices > 1 and dist.strategy == "none":
            raise ValueError(
                f"resources.devices: {devices} needs distributed.strategy ddp or fsdp (one process a device)"
            )
        if dist.gradient_compression != "none" and dist.strategy != "ddp":
            raise ValueError(
                f"distributed.gradient_compression: {dist.gradient_compression} compresses what DDP "
                f"all-reduces; it needs distributed.strategy ddp, not {dist.strategy}"
            )
        global_batch = self.train.global_batch_size or self.train.batch_size
        if isinstance(global_batch, int) and global_batch < devices:
            raise ValueError(
                f"resources.devices: {devices} processes share a global batch of {global_batch} examples; "
                "each needs at least one (raise train.global_batch_size)"
            )
        if dist.strategy == "fsdp" and isinstance(global_batch, int) and global_batch % devices:
            raise ValueError(
                f"resources.devices: FSDP's {devices} processes must share each step's {global_batch} "
                "examples evenly (each runs the same forwards): make the global batch a multiple"
            )
        if dist.strategy == "fsdp" and self.train.batch_size == "auto":
            raise ValueError(
                "train.batch_size: auto is not supported with distributed.strategy fsdp yet (the search "
                "would measure the unsharded model); give a number"
            )
        if dist.strategy == "fsdp" and self.adapt.lora is not None:
            raise ValueError("distributed.strategy: fsdp with adapt.lora is not supported yet (use ddp)")
        if dist.strategy != "none" and self.train.compile:
            raise ValueError("train.compile: not supported with distributed.strategy yet")
        return self

    @model_validator(mode="after")
    def _length_of_training(self) -> JobSpec:
        if self.train.max_steps is None and self.train.epochs is None:
            self.train.epochs = 1.0
        if self.model.task == "image-classification" and self.data.tokenizer is not None:
            raise ValueError("data.tokenizer is meaningless for image-classification")
        return self

    def file_references(self) -> list[tuple[str, Path]]:
        """The files and directories this spec reads, by the field that names them (what a server
        confines to its data roots)."""
        paths = []
        for field, value in (("data.train", self.data.train), ("data.eval", self.data.eval)):
            if value and value.partition(":")[0] not in DATA_SCHEMES:
                paths.append((field, Path(value)))
        if self.data.tokenizer and self.data.tokenizer.startswith("hf:"):
            paths.append(("data.tokenizer", Path(self.data.tokenizer[3:])))
        scheme, _, rest = self.model.source.partition(":")
        if scheme == "hf":
            paths.append(("model.source", Path(rest)))
        elif scheme == "python" and rest.split(":")[0].endswith(".py"):
            paths.append(("model.source", Path(rest.split(":")[0])))
        return paths


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'8GiB' -> 8589934592; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a memory size (e.g. 512MiB, 8GiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_DURATION = re.compile(
    r"\s*(?:([0-9]*\.?[0-9]+)\s*d)?\s*(?:([0-9]*\.?[0-9]+)\s*h)?\s*"
    r"(?:([0-9]*\.?[0-9]+)\s*m)?\s*(?:([0-9]*\.?[0-9]+)\s*s?)?\s*"
)


def parse_duration(text: str | float) -> float:
    """'90m' -> 5400.0, '1h30m' -> 5400.0, '45s' or 45 -> 45.0: seconds, more than 0."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = _DURATION.fullmatch(str(text))
        if not m or not any(m.groups()):
            raise ValueError(f"'{text}' is not a duration (e.g. 45s, 90m, 2h, 1h30m, 1d)")
        days, hours, minutes, secs = (float(g) if g else 0.0 for g in m.groups())
        seconds = days * 86400 + hours * 3600 + minutes * 60 + secs
    if not 0 < seconds <= 366 * 86400:
        raise ValueError(f"'{text}': a duration must be more than 0 and at most a year")
    return seconds


# pydantic names the branch of a union in an error's location (`int`, `literal['auto']`): not a field
_UNION_TAG = re.compile(r"int|str|bool|float|literal\[.*\]|function-\w+\[.*\]")
# what a value of the wrong type should have been, by pydantic's error type
_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
}
# names other tools use for a field, by the name it has here (suggested when the section has that field)
ALIASES = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "epoch": "epochs",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "n_epochs": "epochs",
    "batch": "batch_size",
    "bs": "batch_size",
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "total_steps": "max_steps",
    "train_steps": "max_steps",
    "max_grad_norm": "grad_clip",
    "gradient_clipping": "grad_clip",
    "clip_grad_norm": "grad_clip",
    "dtype": "precision",
    "mixed_precision": "precision",
    "warmup": "warmup_steps",
    "eval_steps": "eval_every",
    "save_steps": "checkpoint_every",
    "logging_steps": "log_every",
    "save_total_limit": "keep_checkpoints",
    "rank": "r",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "text_column": "text_field",
    "label_column": "label_field",
    "max_seq_length": "max_length",
    "max_seq_len": "max_length",
    "seq_len": "max_length",
    "train_file": "train",
    "eval_file": "eval",
    "validation": "eval",
    "gpus": "devices",
    "num_gpus": "devices",
    "device": "device_type",
}


def _section(path: tuple) -> type[BaseModel] | None:
    """The section model at a dotted path of JobSpec (`("adapt", "lora")` -> LoraSpec), if there is one."""
    section: type[BaseModel] = JobSpec
    for part in path:
        field = section.model_fields.get(str(part))
        if field is None:
            return None
        kinds = [t for t in (field.annotation, *get_args(field.annotation)) if isinstance(t, type)]
        section = next((t for t in kinds if issubclass(t, BaseModel)), None)
        if section is None:
            return None
    return section


def suggest_key(path: tuple) -> str | None:
    """The field an unknown key probably meant: a close spelling of a field of its section, or of another
    tool's name for one (learning_rate -> lr)."""
    section = _section(path[:-1])
    if section is None:
        return None
    fields = list(section.model_fields)
    names = {f: f for f in fields} | {a: f for a, f in ALIASES.items() if f in fields}
    close = difflib.get_close_matches(str(path[-1]).lower(), list(names), n=1, cutoff=0.7)
    return ".".join([*(str(p) for p in path[:-1]), names[close[0]]]) if close else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MAX_PROBLEMS = 10  # told one by one (with their suggestions); past them, a count: a request buys no more work


def problem_paths(err: ValidationError) -> dict[str, list[dict]]:
    """The errors by dotted path (union branches' tags left out), in the order pydantic found them."""
    by_path: dict[str, list[dict]] = {}
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not _UNION_TAG.fullmatch(str(p)))
        by_path.setdefault(".".join(str(p) for p in loc), []).append({**e, "loc": loc})
    return by_path


def validation_problems(
    err: ValidationError, limit: int | None = None, by_path: dict[str, list[dict]] | None = None
) -> list[tuple[str, str]]:
    """(dotted path, what is wrong) a problem, for the first `limit` paths (all by default; `by_path`:
    problem_paths(err), where the caller has it); the branches of a union that all refused a value's type
    are one problem (`must be an integer or 'auto', got 'x'`)."""
    by_path = problem_paths(err) if by_path is None else by_path
    problems = []
    for path, errors in list(by_path.items())[:limit]:
        expected = [
            e["ctx"]["expected"] if e["type"] == "literal_error" else _EXPECTED.get(e["type"]) for e in errors
        ]
        if all(expected):
            problems.append(
                (path, f"must be {' or '.join(dict.fromkeys(expected))}, got {_shown(errors[0]['input'])}")
            )
            continue
        for e in errors:
            msg = e["msg"].removeprefix("Value error, ")
            msg = (
                msg.replace("Extra inputs are not permitted", "unknown key")
                .replace("Input should be greater than or equal to", "must be >=")
                .replace("Input should be greater than", "must be >")
                .replace("Input should be less than or equal to", "must be <=")
                .replace("Input should be less than", "must be <")
                .replace("Input should be", "must be")
            )
            if e["type"] == "extra_forbidden" and (suggestion := suggest_key(e["loc"])):
                msg += f" (did you mean {suggestion}?)"
            problems.append((path, msg))
    return list(dict.fromkeys(problems))


def _blamed(path: str, msg: str, set_by: dict[str, str]) -> str | None:
    """The `--set` assignment that made this problem: it set the value at `path` or one above it, or, for
    an unknown key, one below it (`--set trian.lr=1` makes the unknown section `trian`)."""
    for key, assignment in set_by.items():
        if (
            path == key
            or path.startswith(key + ".")
            or (msg.startswith("unknown key") and key.startswith(path + "."))
        ):
            return assignment
    return None


def format_validation_error(
    err: ValidationError, overrides: list[str] = (), origin: str | None = None
) -> str:
    """The problems, `; `-separated, each naming its dotted path: `train.lr: must be > 0`. The file's
    problems come first, after `origin` (the spec file) where given; then those of values a `--set` made,
    each naming it: `--set train.lr=abc: must be a number, got 'abc'`."""
    set_by = {a.partition("=")[0].strip(): a for a in overrides}
    in_file, in_overrides = [], []
    by_path = problem_paths(err)
    more = len(by_path) - MAX_PROBLEMS
    for path, msg in validation_problems(err, MAX_PROBLEMS, by_path):
        assignment = _blamed(path, msg, set_by) if path else None
        if assignment is not None:
            in_overrides.append(f"--set {assignment}: {msg}")
        else:
            in_file.append(f"{path}: {msg}" if path else msg)
    if in_file and origin:
        in_file[0] = f"{origin}: {in_file[0]}"
    told = "; ".join(in_file + in_overrides)
    return told if more <= 0 else f"{told}; ... and {more:,} more"


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `--set a.b.c=value` to the raw spec; the value is parsed as YAML (3, 1e-3, true)."""
    key, sep, value_text = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise SpecError(f"--set {assignment}: expected key.path=value, e.g. train.lr=1e-3")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        value = value_text
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"--set {assignment}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
SCRIPT_ENV_RESERVED = ("GPUFORGE_", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH")


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
            if name.startswith(SCRIPT_ENV_RESERVED[0]) or name in SCRIPT_ENV_RESERVED[1:]:
                raise ValueError(f"{name}: gpuforge sets this one itself")
        return v

    @field_validator("files")
    @classmethod
    def _relative(cls, v: list[str]) -> list[str]:
        for f in v:
            if not f or Path(f).is_absolute() or ".." in Path(f).parts:
                raise ValueError(f"{f!r}: a path inside the job's folder (relative, no '..')")
        return v


MAX_SCRIPT_FILES = 2000  # files a script job's working copy may hold (folders counted by their files)


def working_copy_files(script: ScriptSpec, workdir: Path) -> list[str]:
    """The files `script.files` names, folders walked, as paths relative to the working copy (what
    `submit` sends); a SpecError for one that is missing, leaves the folder, or too many."""
    root = workdir.resolve()
    found: list[str] = []
    for name in script.files:
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise SpecError(f"script.files: {name} leaves the job's folder")
        if not path.exists():
            raise SpecError(f"script.files: {name} not found in {root}")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if not f.resolve().is_relative_to(root):
                raise SpecError(f"script.files: {f.relative_to(root)} links outside the job's folder")
            found.append(f.relative_to(root).as_posix())
        if len(found) > MAX_SCRIPT_FILES:
            raise SpecError(f"script.files: over {MAX_SCRIPT_FILES} files; send the data as data, not code")
    return list(dict.fromkeys(found))


class ScriptJobSpec(Section):
    """A job that runs the team's own command (any framework) with gpuforge's devices, run directory, cost
    and stop signals, but not its engine: no model, data or training sections."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)
    kind: Literal["script"]
    script: ScriptSpec
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first (server)")

    @model_validator(mode="after")
    def _one_device_without_torchrun(self) -> ScriptJobSpec:
        if self.resources.devices > 1 and self.script.launcher != "torchrun":
            raise ValueError(
                f"resources.devices: {self.resources.devices} needs script.launcher torchrun "
                "(one process a device); a script that uses several devices itself asks for one job's worth"
            )
        return self


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
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


def parse_spec(
    raw: Any, base_dir: Path, overrides: list[str] = (), default_name: str = "job", origin: str | None = None
) -> JobSpec | ScriptJobSpec:
    """Validate a raw (YAML-decoded) spec, after overrides, with paths resolved against base_dir. A problem
    is blamed on the `--set` that made it, else on `origin` (the spec file's name) where given."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        where = f"{origin}: " if origin else ""
        raise SpecError(
            f"{where}the spec must be a mapping of sections (model, data, train, ...), "
            f"got {type(raw).__name__}"
        )
    for assignment in overrides:
        apply_override(raw, assignment)
    raw.setdefault("name", default_name)
    _resolve_paths(raw, base_dir)
    try:
        if raw.get("kind") == "script":
            if isinstance(raw.get("script"), dict):
                raw["script"].setdefault("workdir", str(base_dir.resolve()))
            return ScriptJobSpec.model_validate(raw)
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, overrides, origin)) from None


def load_train_spec(path: str | Path, overrides: list[str], verb: str) -> JobSpec:
    """load_spec for a verb that works on gpuforge's engine: a script job is refused, saying why."""
    spec = load_spec(path, overrides)
    if spec.kind == "script":
        raise SpecError(
            f"{path}: kind: script: {verb} is for jobs gpuforge trains (a script runs its own code)"
        )
    return spec


def load_spec(path: str | Path, overrides: list[str] = ()) -> JobSpec | ScriptJobSpec:
    """Read a spec file; every problem becomes a SpecError naming the file and the field."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such spec file")
    if path.is_dir():
        raise SpecError(f"{path}: is a directory, expected a YAML spec file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{path}{where}: malformed YAML: {problem}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file") from None
    name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip(".-_") or "job"
    return parse_spec(raw, path.resolve().parent, overrides, default_name=name, origin=str(path))
