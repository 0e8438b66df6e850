"""Connecting to a Ray cluster and what it offers: the device inventory of its alive nodes and their labels.

Light on purpose: the server imports it for the devices alone, so it imports neither the ranks' supervision
(``ray_ranks.py``) nor the actor that runs a rank on a node (``ray_rank_actor.py``).

Labels: a node's labels are its Ray node labels (``ray start --labels=site=onprem``) and its custom resources
named ``label:NAME=VALUE`` (``ray start --resources='{"label:site=onprem": 1}'``, for a Ray without node
labels); ``ray_placement.py`` keeps a job's ranks on the nodes whose labels match.

Ray is an optional dependency (``pip install 'gpuforge[ray]'``); it is imported only when used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from gpuforge.errors import GpuforgeError

log = logging.getLogger(__name__)

LABEL_RESOURCE = "label:"  # a custom resource "label:site=onprem" labels its node too (any Ray version)
_RAY_OWN_LABELS = "ray.io/"  # Ray's own labels (node id, accelerator type): not the operator's


class RayLaunchError(GpuforgeError):
    """The Ray cluster cannot be reached, cannot hold the job, or a rank cannot be started on it."""


def import_ray() -> Any:
    """The ray module, or an error that says how to install it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RayLaunchError("the Ray executor needs the ray package: pip install 'gpuforge[ray]'") from e
    return ray


def connected_ray() -> Any:
    """The ray module of a process connected to a cluster."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RayLaunchError("not connected to a Ray cluster: call connect(address) first")
    return ray


# --------------------------------------------------------------------------------------------- connect


def _split_address(address: str) -> tuple[str, int] | None:
    """host, port of an explicit address (``host:port`` or ``ray://host:port``); None for auto/local."""
    addr = address.strip()
    if addr.startswith("ray://"):
        addr = addr[len("ray://") :]
    if addr in ("", "auto", "local") or ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        return None


@contextlib.contextmanager
def _bounded_gcs_connect(timeout_s: float):
    """Bound how long ray.init waits for a GCS that does not answer (by default 20 tries of ~40 s).

    The Python side reads RAY_gcs_server_port_wait_time_s (the number of ~1 s tries) at each call; the C++
    side reads its connect timeouts from the environment when its config is (re)initialized, which
    ``ray._raylet.Config.initialize("")`` does. Each try costs about 3 timeouts + 1 s.
    """
    per = str(max(1, int(timeout_s / 4)))
    bounds = {
        "RAY_gcs_server_port_wait_time_s": "1",
        "RAY_py_gcs_connect_timeout_s": per,
        "RAY_gcs_rpc_server_connect_timeout_s": per,
    }
    saved = {k: os.environ.get(k) for k in bounds}
    for k, v in bounds.items():
        os.environ.setdefault(k, v)  # an operator's own setting wins
    try:
        try:
            from ray._raylet import Config

            Config.initialize("")
        except Exception as e:  # a private API: without it, the TCP check and Ray's own bounds remain
            log.debug("could not bound Ray's GCS connect timeouts: %s", e)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def connect(address: str, timeout_s: float = 15) -> None:
    """Connect this process to the Ray cluster at ``address`` (``host:port`` of its head, or ``auto``).

    Raises :class:`RayLaunchError` naming the address and what to check when nothing answers there, within
    about ``timeout_s``. A process already connected stays connected (Ray holds one cluster per process).
    """
    ray = import_ray()
    if ray.is_initialized():
        return
    hint = (
        "check that the head node runs (`ray start --head --port=PORT`), that ADDR is its GCS address "
        "host:port (port 6379 by default, as `ray status` on the head prints it), that this machine reaches "
        "that port (firewall), and that this machine has the cluster's Ray and Python versions"
    )
    hp = _split_address(address)
    if hp is not None:
        try:
            with socket.create_connection(hp, timeout=max(0.5, min(timeout_s, 5.0))):
                pass
        except OSError as e:
            raise RayLaunchError(
                f"no Ray cluster answers at {address} ({e.strerror or e}): {hint.replace('ADDR', address)}"
            ) from e
    t0 = time.monotonic()
    try:
        with _bounded_gcs_connect(timeout_s):
            ray.init(
                address=address,
                ignore_reinit_error=True,
                logging_level=logging.WARNING,
                log_to_driver=False,  # run_ranks streams the ranks' output itself
            )
    except Exception as e:
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise RayLaunchError(
            f"cannot connect to the Ray cluster at {address} after {time.monotonic() - t0:.0f} s "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}): "
            f"{hint.replace('ADDR', address)}"
        ) from e


def cluster_devices() -> dict[str, Any]:
    """Totals of the connected cluster: ``{"cpus", "gpus", "nodes", "resources"}`` (alive nodes only), and
    ``per_node``: each alive node as :func:`cluster_nodes` gives it."""
    ray = connected_ray()
    total = ray.cluster_resources()
    per_node = cluster_nodes()
    return {
        "cpus": float(total.get("CPU", 0.0)),
        "gpus": float(total.get("GPU", 0.0)),
        "nodes": len(per_node),
        "resources": dict(total),
        "per_node": per_node,
    }


# --------------------------------------------------------------------------------------------- labels


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    """The labels of one entry of ``ray.nodes()``: its Ray node labels (``ray start --labels``) but Ray's own
    (``ray.io/...``), and its custom resources named ``label:NAME=VALUE`` (``ray start --resources``)."""
    labels = {
        str(k): str(v)
        for k, v in (node.get("Labels") or {}).items()
        if not str(k).startswith(_RAY_OWN_LABELS)
    }
    for name in node.get("Resources") or {}:
        if name.startswith(LABEL_RESOURCE):
            key, eq, value = name[len(LABEL_RESOURCE) :].partition("=")
            if eq and key and value:
                labels.setdefault(key, value)
    return labels


def cluster_nodes() -> list[dict[str, Any]]:
    """The alive nodes of the connected cluster, by node id: ``{"node_id", "ip", "cpus", "gpus", "labels",
    "resources", "ray_labels"}`` (``ray_labels``: the node's Ray labels as Ray has them, its own included)."""
    ray = import_ray()
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = dict(n.get("Resources") or {})
        nodes.append(
            {
                "node_id": n["NodeID"],
                "ip": n.get("NodeManagerAddress", ""),
                "cpus": float(res.get("CPU", 0.0)),
                "gpus": float(res.get("GPU", 0.0)),
                "labels": node_labels(n),
                "resources": res,
                "ray_labels": dict(n.get("Labels") or {}),
            }
        )
    return sorted(nodes, key=lambda n: n["node_id"])
