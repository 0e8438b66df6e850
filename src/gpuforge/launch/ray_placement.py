"""Where a job's ranks may run on a Ray cluster: one placement group, a bundle per rank, on the nodes whose
labels match the job's ``resources.placement``.

With ``placement={"site": "onprem"}``, every bundle of the placement group gets a label selector naming the
nodes that carry those labels (their ``ray.io/node-id``), so every rank runs on one of them; a Ray without
label selectors asks a sliver of each ``label:`` resource instead (see :func:`ray_cluster.node_labels` for
where labels come from). A placement no alive node carries, or ranks that ask more than the matching nodes
have together, are refused before anything is placed.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuforge.launch.ray_cluster import LABEL_RESOURCE, RayLaunchError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_NODE_ID_LABEL = "ray.io/node-id"
_LABEL_ASK = 0.001  # of a label resource, per rank: a node offering 1 of it takes up to 1000 ranks


def matching_nodes(nodes: list[dict[str, Any]], placement: Mapping[str, str] | None) -> list[dict[str, Any]]:
    """The nodes that carry every label of ``placement`` (all of them for none)."""
    wanted = dict(placement or {})
    return [n for n in nodes if all(n["labels"].get(k) == v for k, v in wanted.items())]


def describe_labels(nodes: list[dict[str, Any]]) -> str:
    """'site=onprem (1 node), gpu=h100 (2 nodes)', or 'none'."""
    counts = collections.Counter(f"{k}={v}" for n in nodes for k, v in n["labels"].items())
    return ", ".join(f"{lv} ({c} node{'s' if c > 1 else ''})" for lv, c in sorted(counts.items())) or "none"


@dataclass
class RankPlacement:
    """What the placement group of a job's ranks asks: each rank's custom resources (label asks included),
    each rank's bundle, and the label selector of every bundle (None: any node)."""

    resources: list[dict[str, float]]
    bundles: list[dict[str, float]]
    selector: dict[str, str] | None
    strategy: str


def plan_placement(
    world_size: int,
    cpus_per_rank: float,
    gpus_per_rank: float,
    resources: list[dict[str, float]],
    nodes: list[dict[str, Any]],
    placement: Mapping[str, str] | None,
    strategy: str,
) -> RankPlacement:
    """The placement of ``world_size`` ranks on ``nodes`` (as ``cluster_nodes()`` gives them); raises
    :class:`RayLaunchError` when no node matches ``placement`` or the matching ones are too small."""
    selector, label_asks = _placement_constraint(placement, nodes)
    resources = [{**res, **label_asks} for res in resources]
    _check_fits(world_size, cpus_per_rank, gpus_per_rank, resources, nodes, placement)
    bundles = [_bundle(cpus_per_rank, gpus_per_rank, res) for res in resources]
    return RankPlacement(resources, bundles, selector, strategy)


def create_placement_group(plan: RankPlacement) -> Any:
    """The placement group of ``plan``: placed by Ray as soon as the cluster has room for it."""
    from ray.util.placement_group import placement_group

    if plan.selector is None:
        return placement_group(plan.bundles, strategy=plan.strategy)
    # every bundle, so every rank's actor, on a node whose labels match
    return placement_group(
        plan.bundles, strategy=plan.strategy, bundle_label_selector=[plan.selector] * len(plan.bundles)
    )


def wait_for_placement(
    ray: Any, pg: Any, stop: threading.Event, t0: float, placement_timeout_s: float, what: str
) -> bool:
    """Wait until the cluster has room for the placement group; False when ``stop`` was set first."""
    placed = pg.ready()
    while not ray.wait([placed], timeout=0.5)[0]:
        if stop.is_set():
            return False
        if time.monotonic() - t0 > placement_timeout_s:
            raise RayLaunchError(
                f"Ray could not place {what} within {placement_timeout_s:g} s: other jobs hold the "
                "resources, or no node offers them together"
            )
    return True


def rank_resources(
    world_size: int, resources_per_rank: Mapping[str, float] | Sequence[Mapping[str, float]] | None
) -> list[dict[str, float]]:
    """Each rank's custom resources: one dict for every rank, or a list with one per rank."""
    if resources_per_rank is None:
        return [{} for _ in range(world_size)]
    if isinstance(resources_per_rank, Mapping):
        return [dict(resources_per_rank) for _ in range(world_size)]
    per = [dict(r) for r in resources_per_rank]
    if len(per) != world_size:
        raise ValueError(f"resources_per_rank has {len(per)} entries for {world_size} ranks")
    return per


def _label_selector_supported() -> bool:
    import inspect

    from ray.util.placement_group import placement_group

    return "bundle_label_selector" in inspect.signature(placement_group).parameters


def _placement_constraint(
    placement: Mapping[str, str] | None, nodes: list[dict[str, Any]]
) -> tuple[dict[str, str] | None, dict[str, float]]:
    """How to keep every rank on a node whose labels match: ``(label selector of each bundle, custom
    resources each rank adds)``. With Ray's label selectors, the selector names the matching nodes by their
    ``ray.io/node-id`` label (so that labels from either source count); without them, each rank asks a
    sliver of every ``label:NAME=VALUE`` resource. A placement that no alive node matches is an error naming
    the labels that exist."""
    if not placement:
        return None, {}
    wanted = ", ".join(f"{k}={v}" for k, v in placement.items())
    matching = matching_nodes(nodes, placement)
    if not matching:
        raise RayLaunchError(
            f"resources.placement: no alive node of the Ray cluster is labelled {wanted}; "
            f"its nodes' labels: {describe_labels(nodes)}"
        )
    if _label_selector_supported() and all(_NODE_ID_LABEL in n["ray_labels"] for n in matching):
        ids = ",".join(n["ray_labels"][_NODE_ID_LABEL] for n in matching)
        return {_NODE_ID_LABEL: f"in({ids})"}, {}
    asks = {f"{LABEL_RESOURCE}{k}={v}": _LABEL_ASK for k, v in placement.items()}
    missing = [r for r in asks if any(r not in n["resources"] for n in matching)]
    if missing:
        raise RayLaunchError(
            f"resources.placement {wanted}: this Ray has no label selectors; label the nodes with the custom "
            f"resources {', '.join(missing)} (ray start --resources='{{\"{missing[0]}\": 1}}')"
        )
    return None, asks


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """One rank's placement-group bundle; Ray refuses zero amounts, so they are left out."""
    b = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in resources.items()}}
    return {k: v for k, v in b.items() if v > 0}


def _check_fits(
    world_size: int,
    cpus: float,
    gpus: float,
    resources: list[dict[str, float]],
    nodes: list[dict[str, Any]],
    placement: Mapping[str, str] | None = None,
) -> None:
    """The ranks ask no more than the nodes they may run on have, together."""
    nodes = matching_nodes(nodes, placement)
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n["resources"].items():
            total[k] = total.get(k, 0.0) + float(v)
    asks: dict[str, float] = {"CPU": cpus * world_size, "GPU": gpus * world_size}
    for res in resources:
        for k, v in res.items():
            asks[k] = asks.get(k, 0.0) + v
    short = [
        f"{v:g} {k} (the cluster has {total.get(k, 0.0):g})"
        for k, v in asks.items()
        if v > 0 and v > total.get(k, 0.0) + 1e-9
    ]
    if short:
        on = "the Ray cluster has"
        if placement:
            on = (
                "the Ray cluster's nodes labelled "
                + ", ".join(f"{k}={v}" for k, v in placement.items())
                + " have"
            )
        raise RayLaunchError(
            f"the job's {world_size} ranks ask more than {on} ({len(nodes)} nodes, "
            f"{total.get('CPU', 0.0):g} CPUs, {total.get('GPU', 0.0):g} GPUs): they ask " + ", ".join(short)
        )
