"""What one compressed variant is made with: the options of `gpuforge compress`, checked when made.

Their bounds are spec/compress_bounds.py's (the spec's `compress:` section takes the same types and
rules), so a job spec and the command line refuse the same requests; a problem here names the flag
(`--prune-structure`).
Light to import (no torch): the CLI builds its flags from these fields.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuforge.errors import GpuforgeError
from gpuforge.spec import (
    CompressSpec,
    PruneStructure,
    QuantKind,
    RecoverSteps,
    Sparsity,
    pruning_problem,
    validation_problems,
)


class CompressError(GpuforgeError):
    """A compress request that cannot be carried out (bad arguments, not an artifact, output exists)."""


def flag(field: str) -> str:
    """The command-line flag of a CompressOptions field: recover_steps -> --recover-steps."""
    return "--" + field.replace("_", "-")


class CompressOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prune: Sparsity = Field(0.0, description="fraction of weights (or channels) to remove")
    prune_structure: PruneStructure = Field("unstructured", description=" | ".join(get_args(PruneStructure)))
    quantize: QuantKind | None = Field(None, description=" | ".join(get_args(QuantKind)))
    merge: bool = Field(False, description="fold a LoRA adapter into its base")
    recover_steps: RecoverSteps = Field(0, description="fine-tune steps after pruning, on the run's data")
    # None: the run's lr for a full fine-tune, 5e-5 after LoRA
    recover_lr: float | None = Field(None, gt=0, description="default: the run's lr")

    @model_validator(mode="wrap")
    @classmethod
    def _problems_name_their_flags(cls, values: Any, handler) -> CompressOptions:
        try:
            options = handler(values)
        except ValidationError as err:
            raise CompressError(
                "; ".join(f"{flag(path)}: {msg}" if path else msg for path, msg in validation_problems(err))
            ) from None
        if problem := pruning_problem(options.prune, options.prune_structure, options.recover_steps, flag):
            raise CompressError(problem)
        return options

    @classmethod
    def from_spec(cls, wanted: CompressSpec) -> CompressOptions:
        """The variant a spec's `compress:` section asks for (its sweep flag aside)."""
        prune = wanted.prune
        if prune is None:
            return cls(quantize=wanted.quantize, merge=wanted.merge)
        return cls(
            prune=prune.amount,
            prune_structure=prune.structure,
            recover_steps=prune.recover_steps,
            quantize=wanted.quantize,
            merge=wanted.merge,
        )

    @property
    def name(self) -> str:
        """Short and distinct, so a table at 80 columns shows it whole: prune50 (unstructured, 50%),
        2:4, channel30, each +rec<N> after recovery, then the quantization. An adapter is always merged
        before pruning or quantizing, so "merged" is named only when it is all that was done."""
        parts = []
        if self.prune:
            percent = f"{self.prune * 100:g}"
            short = {"unstructured": f"prune{percent}", "2:4": "2:4", "channel": f"channel{percent}"}
            parts.append(short[self.prune_structure])
            if self.recover_steps:
                parts.append(f"rec{self.recover_steps}")
        if self.quantize:
            parts.append(self.quantize)
        return "+".join(parts) or ("merged" if self.merge else "original")
