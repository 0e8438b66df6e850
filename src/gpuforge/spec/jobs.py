"""The two kinds of job a spec describes: one gpuforge trains (JobSpec) and one that runs its own command
(ScriptJobSpec), with the rules that tie their sections together."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gpuforge.spec.compress_bounds import CompressSpec
from gpuforge.spec.sections import (
    DATA_SCHEMES,
    EVAL_METRICS,
    AdaptSpec,
    CostSpec,
    DataSpec,
    DistributedSpec,
    ModelSpec,
    ResourcesSpec,
    ScriptSpec,
    Section,
    TrackingSpec,
    TrainSpec,
)


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
        devices, dist = self.resources.processes, self.distributed
        if self.resources.share is not None and dist.strategy != "none":
            raise ValueError(
                f"resources.devices: {self.resources.devices} is a fraction of one device, one process: "
                f"distributed.strategy {dist.strategy} needs whole devices (never two shared ones)"
            )
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
    def _stop_rules(self) -> JobSpec:
        """early_stop, stop_at and keep_best read evaluations: an eval schedule, and metrics it reports."""
        train, data = self.train, self.data
        asked = [
            key
            for key, on in (
                ("train.early_stop", train.early_stop is not None),
                ("train.stop_at", bool(train.stop_at)),
                ("train.keep_best", train.keep_best),
            )
            if on
        ]
        if not asked:
            return self
        if train.eval_every is None:
            raise ValueError(
                f"{asked[0]}: needs train.eval_every (evaluations during training to judge by); "
                "without it the job evaluates only at its end"
            )
        if data.eval is None and data.eval_fraction == 0:
            raise ValueError(
                f"{asked[0]}: needs an eval set (data.eval, or data.eval_fraction above 0 of data.train)"
            )
        reported = EVAL_METRICS[self.model.task]
        watched = [("train.early_stop.metric", train.early_stop.metric)] if train.early_stop else []
        watched += [(f"train.stop_at.{metric}", metric) for metric in train.stop_at or {}]
        for key, metric in watched:
            if metric not in reported:
                raise ValueError(
                    f"{key}: {metric} is not a figure this job's evaluation reports (a "
                    f"{self.model.task} job's: {', '.join(reported)})"
                )
        if train.keep_best and self.distributed.strategy == "fsdp":
            raise ValueError("train.keep_best: not supported with distributed.strategy fsdp yet (use ddp)")
        return self

    @model_validator(mode="after")
    def _length_of_training(self) -> JobSpec:
        if self.train.max_steps is None and self.train.epochs is None:
            self.train.epochs = 1.0
        if self.model.task == "image-classification" and self.data.tokenizer is not None:
            raise ValueError("data.tokenizer is meaningless for image-classification")
        if self.data.group_by_length and self.model.task != "sequence-classification":
            raise ValueError(
                f"data.group_by_length: a {self.model.task} job's examples have one length (causal-lm "
                "data is packed into blocks); it groups sequence-classification examples"
            )
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
        if self.resources.share is not None and self.script.launcher == "torchrun":
            raise ValueError(
                f"resources.devices: {self.resources.devices} is a fraction of one device: one process, "
                "not script.launcher torchrun"
            )
        if self.resources.processes > 1 and self.script.launcher != "torchrun":
            raise ValueError(
                f"resources.devices: {self.resources.devices} needs script.launcher torchrun "
                "(one process a device); a script that uses several devices itself asks for one job's worth"
            )
        return self
