"""Everything a job needs before its first step, built the same way for `train` and for `plan`.

Each part can fail on bad input (a missing file, an unknown model, a budget too small) and none of them
writes anything: a refused job leaves no trace.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuforge.data import PreparedData, prepare_data
from gpuforge.data.batches import BatchOrder
from gpuforge.distributed.ranks import Ranks
from gpuforge.errors import ModelError
from gpuforge.hardware.probe import select_device
from gpuforge.models import BuiltModel, ModelRequest, build_model, load_tokenizer
from gpuforge.runtime.device_share import cap_cuda_memory
from gpuforge.runtime.precision import Precision, choose_precision
from gpuforge.spec import JobSpec, parse_bytes
from gpuforge.train.adapt import apply_lora, enable_activation_checkpointing
from gpuforge.train.batch import BatchSearch, search_micro_batch
from gpuforge.train.fast_dropout import use_fast_dropout
from gpuforge.weights.qlora import quantize_base

log = logging.getLogger(__name__)


@dataclass
class Job:
    spec: JobSpec
    device: torch.device
    precision: Precision
    tokenizer: Any
    data: PreparedData
    built: BuiltModel
    order: BatchOrder  # the global batch of every step
    micro: int  # examples per forward/backward
    search: BatchSearch | None  # how the micro-batch was found, for batch_size: auto
    total_steps: int

    @property
    def task(self) -> str:
        return self.spec.model.task

    @property
    def module(self) -> torch.nn.Module:
        return self.built.module


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_positions(built: BuiltModel, max_length: int) -> None:
    """A sequence longer than the model's position table fails mid-step; say so before anything runs."""
    config = getattr(built.module, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and max_length > limit:
        raise ModelError(f"data.max_length: {max_length} is more than the {limit} positions the model has")


def build_job(spec: JobSpec, resume: dict[str, Any] | None = None, ranks: Ranks | None = None) -> Job:
    """Seed, pick device and precision, read the data, build the model, size the batch.

    `resume` is the meta of the checkpoint a run resumes from: it keeps its precision and micro-batch.
    `ranks`: this process's place in a distributed job; it takes its local GPU, and its micro-batch is
    sized for its share of the global batch. Every rank seeds alike, so all build the same weights."""
    resume, ranks = resume or {}, ranks or Ranks()
    seed_everything(spec.train.seed)
    device = select_device(spec.resources.device_type)
    if device.type == "cuda" and ranks.local_world > 1:
        device = torch.device("cuda", ranks.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if (capped := cap_cuda_memory(device)) is not None:  # a fraction of a GPU: every rank under its cap
        log.info("CUDA memory capped at %s", capped)
    if spec.train.precision == "auto" and resume.get("precision"):  # a resumed run keeps its numerics
        precision = Precision(resume["precision"], "auto, kept from the checkpoint this run resumes")
    else:
        precision = choose_precision(spec.train.precision, device)

    task = spec.model.task
    tokenizer = load_tokenizer(spec.model.source, task, spec.data.tokenizer)
    data = prepare_data(spec.data, task, tokenizer, spec.train.seed, spec.model.num_labels)
    built = build_model(
        ModelRequest(
            source=spec.model.source,
            task=task,
            num_labels=len(data.labels) if data.labels else None,  # num_labels of the spec included
            labels=data.labels,
            vocab_size=len(tokenizer) if tokenizer is not None else None,
            max_length=spec.data.max_length,
            pretrained=spec.model.pretrained,
            options=spec.model.options,
        )
    )
    check_positions(built, spec.data.max_length)
    if spec.adapt.quantize_base is not None:
        compute = precision.autocast_dtype or torch.float32
        built = quantize_base(built, spec.adapt.quantize_base, spec.adapt.lora.modules_to_save or [], compute)
    if spec.adapt.lora is not None:
        built = apply_lora(built, spec.adapt.lora, task)
    if spec.train.gradient_checkpointing:
        enable_activation_checkpointing(built)
    if built.adapter and precision.autocast_dtype is not None and spec.adapt.quantize_base is None:
        # the frozen base is only read: keep it in the compute dtype instead of casting it every step
        for p in built.module.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(precision.autocast_dtype)
    if built.adapter and precision.autocast_dtype is not None:
        # PEFT casts each LoRA input up to the factors' fp32 and autocast casts it back down for the
        # matmul: two activation copies per adapted layer and pass, for nothing
        for module in built.module.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    if device.type == "cpu" and spec.train.fast_dropout and not spec.train.compile:
        use_fast_dropout(built.module)  # compiled graphs draw masks with inductor's own generator
    if spec.distributed.strategy == "fsdp" and ranks.launched and device.type == "cuda":
        # left in host memory: fully_shard moves each block to the GPU as it shards it, so a GPU never
        # holds more than its shards and one whole block (a model too big for one GPU still starts)
        built.module.train()
    else:
        built.module.to(device).train()

    order = BatchOrder(
        len(data.train),
        spec.train.global_batch_size or spec.train.batch_size,
        spec.train.seed,
        lengths=_lengths_to_group(spec, data.train),
    )
    share = math.ceil(order.global_batch / ranks.world)  # the most examples a process gets a step
    search = None
    # a resumed run keeps its micro-batch (searched, or cut by an OOM), if sized for as many processes
    if resume.get("micro_batch") and resume.get("processes", 1) == ranks.world:
        micro = min(resume["micro_batch"], share)
    elif spec.train.batch_size == "auto":
        budget = parse_bytes(spec.resources.max_memory) if spec.resources.max_memory else None
        search = search_micro_batch(built, task, data.train, share, precision, device, budget)
        micro = search.micro
    else:
        micro = min(spec.train.batch_size, share)
    if spec.train.compile:
        built.module.compile()  # in place: parameter names (and so checkpoints) stay the eager model's
    total_steps = spec.train.max_steps or max(1, math.ceil(spec.train.epochs * order.steps_per_epoch))
    return Job(spec, device, precision, tokenizer, data, built, order, micro, search, total_steps)


def _lengths_to_group(spec: JobSpec, train) -> list[int] | None:
    """data.group_by_length (sequence-classification, spec/jobs.py checks): the examples' lengths."""
    return train.lengths if spec.data.group_by_length else None
