"""The bounds of the compression options and the spec's `compress:` section that takes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from gpuforge.spec.sections import Section

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
