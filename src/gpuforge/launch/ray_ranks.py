"""Run a job's ranks on a Ray cluster: the executor behind ``gpuforge server --executor ray``.

A rank is a command line that reads torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and calls ``init_process_group(init_method="env://")``.
:func:`run_ranks` places one Ray actor per rank (one placement group, one bundle per rank, with the rank's
CPUs, GPUs and custom resources: ``ray_placement.py``), asks rank 0's actor for its node's IP and a free port
(the rendezvous), starts the command on every actor (``ray_rank_actor.py``) as a subprocess with those
variables set, streams each rank's stdout+stderr lines back to the caller and waits for all of them. If a
rank fails, the others get SIGTERM and, after a grace, SIGKILL, so that the job ends instead of hanging in a
collective. The caller's signal handlers stop a job by setting the ``stop`` event: every rank gets SIGTERM,
then SIGKILL after the grace. At the end the actors are killed and the placement group is removed, whatever
happened. Connecting, and the cluster's devices and labels, are ``ray_cluster.py``'s.

Files: logs travel through Ray, and the driver (the server's process) writes them into
``RUN_DIR/logs/rank{r}.log``. Everything else a rank writes (events, metrics, checkpoints: rank 0 writes them
into the run directory path it is given) goes straight to that path on the node the rank runs on, so the run
directory must be on a filesystem every node sees under the same path: true on a single machine or a local
test cluster, NFS (or alike) across machines. A rank whose working directory (by default the run directory)
does not exist on its node fails at start with an error that says so.

GPUs: Ray sets CUDA_VISIBLE_DEVICES for each actor to the GPUs it was given, and the rank inherits it, so
every rank sees its own GPUs from index 0: LOCAL_RANK is 0 when ``gpus_per_rank > 0``. On CPU, LOCAL_RANK is
the rank's index among the ranks on its node. LOCAL_WORLD_SIZE is the number of ranks on the rank's node,
GROUP_RANK the index of its node (in order of the lowest rank on each node).

Ray is an optional dependency (``pip install 'gpuforge[ray]'``); it is imported only when used.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuforge.launch import ray_rank_actor
from gpuforge.launch.ray_cluster import (
    RayLaunchError,
    cluster_nodes,
    connected_ray,
)
from gpuforge.launch.ray_placement import (
    STRATEGIES,
    create_placement_group,
    plan_placement,
    rank_resources,
    wait_for_placement,
)

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how long one poll of an actor waits for lines
_CALL_TIMEOUT_S = 120.0  # a plain actor call (where, free port, start): covers a worker start on a busy node


@dataclass
class RanksResult:
    """How each rank ended. An exit code is negative for a signal (-15: SIGTERM), None for a rank whose
    actor or node was lost, or that did not end within the grace."""

    exit_codes: list[int | None]
    node_ips: list[str] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    failed_rank: int | None = None  # the first rank that ended badly on its own
    stopped: bool = False  # the caller set the stop event
    timed_out: bool = False  # timeout_s ran out
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.exit_codes)


def run_ranks(
    argv: list[str],
    world_size: int,
    run_dir: Path,
    *,
    env: dict[str, str] | None = None,
    gpus_per_rank: float = 0,
    cpus_per_rank: float = 1,
    resources_per_rank: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
    grace_s: float = 30.0,
    strategy: str = "PACK",
    cwd: Path | None = None,
    placement_timeout_s: float = 120.0,
    on_line: Callable[[int, str], None] | None = None,
    placement: Mapping[str, str] | None = None,
) -> RanksResult:
    """Run ``argv`` as ``world_size`` ranks on the connected Ray cluster; see the module docstring.

    ``resources_per_rank``: custom Ray resources each rank's actor asks, one dict for every rank or a list
    with one per rank (to pin ranks to nodes). ``argv[0]`` ``python``/``python3`` becomes the Python of the
    node's Ray. ``env`` is added to every rank's environment. Each rank's output goes, line by line, to
    ``run_dir/logs/rank{r}.log`` (appended) and to ``on_line(rank, line)``. ``stop``: set it (from a signal
    handler) to stop the job: SIGTERM to every rank, SIGKILL after ``grace_s``; the result then says
    ``stopped``. A failed rank, or ``timeout_s`` running out, stops the others the same way. ``strategy``:
    the placement group's (PACK keeps ranks on few nodes, SPREAD spreads them). ``placement``: labels
    (``{"site": "onprem"}``) every rank's node must carry, Ray node labels or ``label:NAME=VALUE`` custom
    resources (see :func:`ray_cluster.node_labels`). Raises :class:`RayLaunchError` when the cluster cannot
    hold the job (no node matches ``placement``, or the matching ones are too small), or a rank cannot be
    started.
    """
    ray = connected_ray()
    per_rank = _checked_resources(
        argv, world_size, strategy, cpus_per_rank, gpus_per_rank, resources_per_rank
    )
    plan = plan_placement(
        world_size, cpus_per_rank, gpus_per_rank, per_rank, cluster_nodes(), placement, strategy
    )

    t0 = time.monotonic()
    run_dir = Path(run_dir).resolve()
    logs_dir = run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    workdir = str(Path(cwd).resolve() if cwd is not None else run_dir)
    stop = stop if stop is not None else threading.Event()

    pg = create_placement_group(plan)
    # By value: a worker hosts the actor without importing its module (see ray_rank_actor's docstring).
    ray.cloudpickle.register_pickle_by_value(ray_rank_actor)
    actors: list[Any] = []
    finished = [False] * world_size
    result = RanksResult(exit_codes=[None] * world_size)
    files = []
    watched = False
    try:
        labelled = ", ".join(f"{k}={v}" for k, v in (placement or {}).items())
        on = f", on nodes labelled {labelled}" if labelled else ""
        what = f"{world_size} ranks ({plan.bundles[0]} each, strategy {strategy}{on})"
        if not wait_for_placement(ray, pg, stop, t0, placement_timeout_s, what):
            result.stopped = True  # stopped while waiting for room: no rank ever ran
            result.seconds = time.monotonic() - t0
            return result
        _place_actors(ray, pg, cpus_per_rank, gpus_per_rank, plan.resources, actors)
        where = _rendezvous(ray, actors, result)
        envs = _rank_environments(where, env, gpus_per_rank, result.master_addr, result.master_port)
        files = [open(logs_dir / f"rank{r}.log", "a", encoding="utf-8") for r in range(world_size)]  # noqa: SIM115
        _start_ranks(ray, actors, argv, envs, workdir)
        log.debug(
            "%d ranks placed on %s and started in %.1f s; rendezvous %s:%d",
            world_size,
            result.node_ips,
            time.monotonic() - t0,
            result.master_addr,
            result.master_port,
        )
        _watch(ray, actors, files, result.exit_codes, finished, result, stop, grace_s, timeout_s, t0, on_line)
        watched = True
    finally:
        # left by an error (or KeyboardInterrupt) mid-watch: the ranks still running must not outlive the job
        # (strict=False: no actors yet when the error came before they were placed)
        left_running = [] if watched else [a for a, done in zip(actors, finished, strict=False) if not done]
        _tear_down(ray, pg, actors, files, left_running, grace_s)
    result.seconds = time.monotonic() - t0
    return result


def _checked_resources(
    argv: list[str],
    world_size: int,
    strategy: str,
    cpus_per_rank: float,
    gpus_per_rank: float,
    resources_per_rank: Mapping[str, float] | Sequence[Mapping[str, float]] | None,
) -> list[dict[str, float]]:
    """The custom resources of each rank, once the arguments are known to make sense."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if not argv:
        raise ValueError("argv is empty")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    per_rank = rank_resources(world_size, resources_per_rank)
    if cpus_per_rank <= 0 and gpus_per_rank <= 0 and not any(per_rank):
        raise ValueError(
            "each rank must ask for some resource (cpus_per_rank, gpus_per_rank or a custom one)"
        )
    return per_rank


def _place_actors(
    ray: Any,
    pg: Any,
    cpus_per_rank: float,
    gpus_per_rank: float,
    per_rank: list[dict[str, float]],
    actors: list[Any],
) -> None:
    """One actor per rank, each in its own bundle of the placement group, appended to `actors` as it is
    made: should one fail, the caller still holds (and kills) those made before it."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_cls = ray.remote(ray_rank_actor.RankProcess)
    for r, res in enumerate(per_rank):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r)
        actors.append(
            actor_cls.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                resources=res or None,
                max_concurrency=4,  # poll and terminate run side by side
                scheduling_strategy=strategy,
            ).remote()
        )


def _rendezvous(ray: Any, actors: list[Any], result: RanksResult) -> list[dict[str, Any]]:
    """Where each actor runs, and rank 0's address and a free port there (into ``result``)."""
    try:
        where = ray.get([a.where.remote() for a in actors], timeout=_CALL_TIMEOUT_S)
        result.master_port = ray.get(actors[0].free_port.remote(), timeout=_CALL_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as e:
        raise RayLaunchError(f"the ranks' Ray actors did not start: {type(e).__name__}: {e}") from e
    result.node_ips = [w["ip"] for w in where]
    result.node_ids = [w["node_id"] for w in where]
    result.master_addr = where[0]["ip"]
    return where


def _rank_environments(
    where: list[dict[str, Any]],
    env: dict[str, str] | None,
    gpus_per_rank: float,
    master_addr: str,
    master_port: int,
) -> list[dict[str, str]]:
    """torchrun's variables for each rank (see the module docstring), over ``env``."""
    node_order: list[str] = []  # nodes in order of their lowest rank
    on_node: dict[str, list[int]] = {}
    for r, w in enumerate(where):
        if w["node_id"] not in on_node:
            node_order.append(w["node_id"])
            on_node[w["node_id"]] = []
        on_node[w["node_id"]].append(r)
    envs = []
    for r, w in enumerate(where):
        peers = on_node[w["node_id"]]
        e = {"PYTHONUNBUFFERED": "1"}  # lines reach the log as they are printed
        e.update(env or {})
        e.update(
            RANK=str(r),
            WORLD_SIZE=str(len(where)),
            LOCAL_RANK="0" if gpus_per_rank > 0 else str(peers.index(r)),
            LOCAL_WORLD_SIZE=str(len(peers)),
            GROUP_RANK=str(node_order.index(w["node_id"])),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        envs.append(e)
    return envs


def _start_ranks(
    ray: Any, actors: list[Any], argv: list[str], envs: list[dict[str, str]], workdir: str
) -> None:
    starts = [a.start.remote(argv, envs[r], workdir) for r, a in enumerate(actors)]
    try:
        ray.get(starts, timeout=_CALL_TIMEOUT_S)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
        raise RayLaunchError(str(cause)) from e
    except (ray.exceptions.RayError, TimeoutError) as e:
        raise RayLaunchError(f"the ranks could not be started: {type(e).__name__}: {e}") from e


def _tear_down(
    ray: Any, pg: Any, actors: list[Any], files: list[Any], stop_first: list[Any], grace_s: float
) -> None:
    """Whatever happened: stop the ranks of ``stop_first`` (SIGTERM, SIGKILL after ``grace_s``), then close
    the logs, kill the actors and remove the placement group."""
    from ray.util.placement_group import remove_placement_group

    try:
        if stop_first:
            refs = [a.terminate.remote(grace_s) for a in stop_first]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace_s + 10)
    finally:
        for f in files:
            f.close()
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _watch(
    ray: Any,
    actors: list[Any],
    files: list[Any],
    codes: list[int | None],
    finished: list[bool],
    result: RanksResult,
    stop: threading.Event,
    grace_s: float,
    timeout_s: float | None,
    t0: float,
    on_line: Callable[[int, str], None] | None,
) -> None:
    """Stream lines into the logs until every rank ended; stop them all on a failure, a timeout, ``stop``."""
    pending = {a.poll.remote(_POLL_S): r for r, a in enumerate(actors)}
    stopping_since: float | None = None

    def stop_all(why: str) -> None:
        nonlocal stopping_since
        if stopping_since is not None:
            return
        stopping_since = time.monotonic()
        log.info("stopping the job's ranks: %s", why)
        for r, a in enumerate(actors):
            if not finished[r]:
                a.terminate.remote(grace_s)

    while pending:
        if stop.is_set():
            if not result.stopped and stopping_since is None:
                result.stopped = True
            stop_all("stop requested")
        if timeout_s is not None and time.monotonic() - t0 > timeout_s and stopping_since is None:
            result.timed_out = True
            stop_all(f"the job ran past its {timeout_s:g} s")
        if stopping_since is not None and time.monotonic() - stopping_since > grace_s + 30:
            log.warning("ranks %s did not end after their grace; giving up on them", sorted(pending.values()))
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.2)
        for ref in ready:
            r = pending.pop(ref)
            try:
                lines, done, rc = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                lines, done, rc = [f"[gpuforge] rank {r}'s Ray actor was lost: {e}"], True, None
            if lines:
                files[r].write("".join(line + "\n" for line in lines))
                files[r].flush()
                if on_line is not None:
                    for line in lines:
                        on_line(r, line)
            if not done:
                pending[actors[r].poll.remote(_POLL_S)] = r
                continue
            finished[r] = True
            codes[r] = rc
            if rc != 0 and stopping_since is None:
                result.failed_rank = r
                stop_all(f"rank {r} ended with exit code {rc}")
