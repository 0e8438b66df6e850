"""The serving options, defined once: `gpuforge serve`'s flags (cli/serve.py), the worker's settings
(serve/worker.py), the options a deployment may set through the server's API (server/schemas.py) and a
replica's command line (scheduler/deployments.py) all come from `ServeOptions`.

    options = ServeOptions(max_batch=8, precision="fp32")
    serve_flags({"max_batch": 8})           ->  ["--max-batch", "8"]
    serve_flags({"eval_at_load": True})     ->  ["--eval-at-load"]
    DeployBody = deployment_options_model("ServeOptions")   # the deployable ones, each optional

Light on purpose (pydantic only): the server and the scheduler import it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, get_args

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, create_model

QUANTIZE_KINDS = ("int8", "int4", "int8-dynamic")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Deployable:
    """Marks an option a deployment may set through the server's API, with the bounds it has there on top
    of its own: a shared server caps what one deployment may ask of its memory and time."""

    ge: float | None = None
    le: float | None = None

    def constraints(self) -> list[Any]:
        return [
            *([annotated_types.Ge(self.ge)] if self.ge is not None else []),
            *([annotated_types.Le(self.le)] if self.le is not None else []),
        ]


def _one_of(choices: Sequence[str]) -> str:
    return f"^({'|'.join(choices)})$"


class ServeOptions(BaseModel):
    """How a worker loads its model, batches and bounds requests. Each field is a flag of `gpuforge serve`
    (`max_batch`: --max-batch); its description is the flag's help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: Annotated[int, Deployable(le=1024)] = Field(32, ge=1, description="inputs per batch at most")
    max_wait_ms: Annotated[float, Deployable(le=10_000)] = Field(
        5.0, ge=0, description="how long a batch waits to fill, once one is coming (never for a lone request)"
    )
    max_queue: Annotated[int, Deployable(le=100_000)] = Field(
        256, ge=1, description="inputs waiting at most; past it 429"
    )
    timeout_s: Annotated[float, Deployable(le=3600)] = Field(
        30.0, ge=0.1, description="per request; past it 504"
    )
    quantize: Annotated[str | None, Deployable()] = Field(
        None, pattern=_one_of(QUANTIZE_KINDS), description=f"{' | '.join(QUANTIZE_KINDS)}, at load"
    )
    precision: Annotated[str, Deployable()] = Field(
        "auto", pattern=_one_of(PRECISIONS), description=" | ".join(PRECISIONS)
    )
    device: str = Field("auto", description="auto | cpu | cuda | mps")  # a deployment's: the scheduler's pick
    max_length: Annotated[int | None, Deployable(ge=1, le=1_000_000)] = Field(
        None, description="tokens per text input (default: as trained)"
    )
    max_body_bytes: int = Field(1 << 20, ge=1, description="a request body over it: 413")
    max_adapters: int = Field(8, ge=1, description="adapters loaded at once (LRU past it)")
    # the server's own, never a deployment's: it asks for the metric a rolling update is judged by, and
    # names the folder its runs live in
    eval_at_load: bool = Field(
        False, description="measure the eval metric on the run's held-out split at load (/info's eval)"
    )
    adapters_root: str | None = Field(
        None, description="a folder: POST /admin/adapters may add LoRA adapters found under it"
    )


CHOICES = {"quantize": QUANTIZE_KINDS, "precision": PRECISIONS}


def flag(name: str) -> str:
    """The command-line flag of option `name`: max_batch -> --max-batch."""
    return "--" + name.replace("_", "-")


def lower_bound(name: str) -> float | None:
    """The least value option `name` takes (its `ge`), or None."""
    return next(
        (m.ge for m in ServeOptions.model_fields[name].metadata if isinstance(m, annotated_types.Ge)), None
    )


def serve_flags(options: Mapping[str, Any]) -> list[str]:
    """`gpuforge serve`'s flags for the options set (not None) in `options`, in ServeOptions' order; a bool
    one is a bare flag when true and left out when false (`--eval-at-load True` would not parse)."""
    flags = []
    for name in ServeOptions.model_fields:
        value = options.get(name)
        if isinstance(value, bool):
            flags += [flag(name)] if value else []
        elif value is not None:
            flags += [flag(name), str(value)]
    return flags


def refusal(error: Mapping[str, Any]) -> str:
    """One of ServeOptions' validation errors as a command line's one-line refusal:
    `--quantize int3: expected int8, int4 or int8-dynamic`."""
    name = str(error["loc"][0])
    choices = CHOICES.get(name)
    if choices is not None:
        why = f"expected {', '.join(choices[:-1])} or {choices[-1]}"
    else:
        why = str(error["msg"])
    return f"{flag(name)} {error['input']}: {why}"


def deployment_options_model(model_name: str) -> type[BaseModel]:
    """A pydantic model of the deployable options (those marked Deployable), each optional (unset: the
    worker's default), with their bounds plus the Deployable ones; unknown fields are refused."""
    fields: dict[str, Any] = {}
    for name, field in ServeOptions.model_fields.items():
        marks = [m for m in field.metadata if isinstance(m, Deployable)]
        if not marks:
            continue
        bounds = [m for m in field.metadata if not isinstance(m, Deployable)]
        value = Annotated[(_without_none(field.annotation), *bounds, *marks[0].constraints())]
        fields[name] = (value | None, Field(None, description=field.description))
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _without_none(annotation: Any) -> Any:
    """`str` of `str | None`; any other annotation as it is."""
    members = [a for a in get_args(annotation) if a is not type(None)]
    return members[0] if len(members) == 1 and type(None) in get_args(annotation) else annotation
