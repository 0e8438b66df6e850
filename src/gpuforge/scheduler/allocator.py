"""The devices a server hands out: each GPU torch sees, and the CPU cut into slots.

A GPU job gets CUDA_VISIBLE_DEVICES naming its GPUs, so inside it they are cuda:0..n-1 whatever their
numbers on the machine. A CPU job gets a slot: a share of the cores (OMP/MKL threads and torch's thread
count set through the environment), so two CPU jobs do not fight over the same cores. The slot count is
GPUFORGE_CPU_SLOTS (default 1: one CPU job at a time, all cores).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace

from gpuforge.runtime.host import usable_cores
from gpuforge.settings import current


@dataclass(frozen=True)
class DeviceInfo:
    id: str  # "cuda:0", "cpu:0"
    kind: str  # "cuda" | "cpu"
    name: str
    memory_bytes: int | None = None
    threads: int | None = None  # CPU slots: cores given to the job
    labels: tuple[tuple[str, str], ...] = ()  # sorted (name, value): what a spec's placement matches
    cores: tuple[int, ...] = ()  # a CPU slot of this machine: its cores (a fraction is pinned to some)


def inventory(cpu_slots: int | None = None) -> list[DeviceInfo]:
    import torch

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(DeviceInfo(f"cuda:{i}", "cuda", props.name, props.total_memory))
    configured = current().cpu_slots
    slots = cpu_slots or (1 if configured is None else configured)
    cores = usable_cores()
    per_slot = max(1, cores // slots)
    ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(cores))
    for i in range(slots):
        name = cpu_slot_name(i, slots, per_slot, cores)
        own = tuple(ids[i * per_slot : (i + 1) * per_slot]) or tuple(ids[-per_slot:])  # more slots than cores
        devices.append(DeviceInfo(f"cpu:{i}", "cpu", name, None, per_slot, cores=own))
    return devices


def cpu_slot_name(index: int, slots: int, per_slot: int, cores: int) -> str:
    """What a CPU slot is, in words that do not read as a usage ("2 of 2" looked like cores taken)."""
    if slots == 1:
        return f"the whole CPU: {cores} core{'s' if cores != 1 else ''}"
    return f"CPU slot {index + 1} of {slots}: {per_slot} core{'s' if per_slot != 1 else ''} of the {cores}"


def cluster_inventory(cluster: dict) -> list[DeviceInfo]:
    """The devices of a Ray cluster (ray_cluster.cluster_devices()) or a Slurm partition: each GPU, and each
    CPU as a slot of one core (GPUFORGE_CPU_SLOTS, when set, caps them, taken from the nodes in turn), each
    with its node's labels (``per_node``; without it, none). Ray (or Slurm) places the ranks, on nodes that
    carry a job's placement labels; these ids only count them."""
    nodes = cluster.get("per_node") or [{"cpus": cluster["cpus"], "gpus": cluster["gpus"], "labels": {}}]
    configured = current().cpu_slots  # 0 is a cap too: no CPU jobs on the cluster
    turns = itertools.zip_longest(*(range(int(n["cpus"])) for n in nodes))
    # a core of each node in turn, so that a cap leaves every node some
    in_turn = [i for turn in turns for i, core in enumerate(turn) if core is not None]
    cpu_nodes = [nodes[i] for i in sorted(in_turn if configured is None else in_turn[:configured])]
    gpu_nodes = [n for n in nodes for _ in range(int(n["gpus"]))]
    devices = [
        DeviceInfo(f"cuda:{i}", "cuda", f"a GPU of {_node(n)}", labels=_labels(n))
        for i, n in enumerate(gpu_nodes)
    ]
    devices += [
        DeviceInfo(f"cpu:{i}", "cpu", f"a CPU core of {_node(n)}", None, 1, _labels(n))
        for i, n in enumerate(cpu_nodes)
    ]
    return devices


def _node(node: dict) -> str:
    if node.get("where"):  # a Slurm node's name (launch/slurm_partition.py)
        return str(node["where"])
    where = f"{node.get('ip', '')} {str(node.get('node_id', ''))[:8]}".strip()
    return f"Ray node {where}" if where else "the Ray cluster"


def _labels(node: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (node.get("labels") or {}).items()))


def job_environment(devices: list[DeviceInfo]) -> dict[str, str]:
    """Environment variables that confine a job's process to its devices."""
    if devices and devices[0].kind == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(d.id.split(":")[1] for d in devices)}
    threads = str(sum(d.threads or 1 for d in devices))
    return {
        "CUDA_VISIBLE_DEVICES": "",  # a CPU job must not grab a GPU another job holds
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }


def parse_labels(text: str, where: str = "GPUFORGE_DEVICE_LABELS") -> dict[str | None, dict[str, str]]:
    """'site=onprem,gpu=h100' -> {None: {...}} (every device); 'cuda:0=gpu=h100;cpu=site=edge' -> per device
    id or kind. ValueError naming `where` and the part that is wrong."""
    found: dict[str | None, dict[str, str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        target: str | None = None
        head, _, rest = part.partition("=")
        if rest and "," not in head and ("=" in rest.split(",")[0]):
            target, part = head.strip(), rest  # "cuda:0=gpu=h100": per device
        labels = found.setdefault(target, {})
        for pair in filter(None, (p.strip() for p in part.split(","))):
            name, eq, value = pair.partition("=")
            if not eq or not name.strip() or not value.strip():
                raise ValueError(f"{where}: {pair!r} is not name=value")
            labels[name.strip()] = value.strip()
    return found


def with_labels(devices: list[DeviceInfo], labels: dict[str | None, dict[str, str]]) -> list[DeviceInfo]:
    """The devices, each with the labels given for all, for its kind, and for its id (the last wins)."""
    out = []
    for d in devices:
        merged = {**labels.get(None, {}), **labels.get(d.kind, {}), **labels.get(d.id, {}), **dict(d.labels)}
        out.append(replace(d, labels=tuple(sorted(merged.items()))))
    return out
