"""Run a job's ranks on a Ray cluster: the executor behind ``gpuforge server --executor ray``.

A rank is a command line that reads torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and calls ``init_process_group(init_method="env://")``.
:func:`run_ranks` places one Ray actor per rank (one placement group, one bundle per rank, with the rank's
CPUs, GPUs and custom resources), asks rank 0's actor for its node's IP and a free port (the rendezvous),
starts the command on every actor as a subprocess with those variables set, streams each rank's
stdout+stderr lines back to the caller and waits for all of them. If a rank fails, the others get SIGTERM
and, after a grace, SIGKILL, so that the job ends instead of hanging in a collective. The caller's signal
handlers stop a job by setting the ``stop`` event: every rank gets SIGTERM, then SIGKILL after the grace.
At the end the actors are killed and the placement group is removed, whatever happened.

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

Placement: a node's labels are its Ray node labels (``ray start --labels=site=onprem``) and its custom
resources named ``label:NAME=VALUE`` (``ray start --resources='{"label:site=onprem": 1}'``, for a Ray
without node labels). With ``placement={"site": "onprem"}``, every bundle of the placement group gets a label
selector naming the nodes that carry those labels (their ``ray.io/node-id``), so every rank runs on one of
them; a Ray without label selectors asks a sliver of each ``label:`` resource instead.

Ray is an optional dependency (``pip install 'gpuforge[ray]'``); it is imported only when used.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuforge.child_env import child_environment
from gpuforge.errors import GpuforgeError

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_POLL_S = 0.5  # how long one poll of an actor waits for lines
_MAX_LINES = 2000  # lines per poll answer
_CALL_TIMEOUT_S = 120.0  # a plain actor call (where, free port, start): covers a worker start on a busy node


class RayLaunchError(GpuforgeError):
    """The Ray cluster cannot be reached, cannot hold the job, or a rank cannot be started on it."""


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RayLaunchError("the Ray executor needs the ray package: pip install 'gpuforge[ray]'") from e
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
    ray = _ray()
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
    ray = _ray()
    if not ray.is_initialized():
        raise RayLaunchError("not connected to a Ray cluster: call connect(address) first")
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

LABEL_RESOURCE = "label:"  # a custom resource "label:site=onprem" labels its node too (any Ray version)
_RAY_OWN_LABELS = "ray.io/"  # Ray's own labels (node id, accelerator type): not the operator's
_NODE_ID_LABEL = "ray.io/node-id"
_LABEL_ASK = 0.001  # of a label resource, per rank: a node offering 1 of it takes up to 1000 ranks


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
    ray = _ray()
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


def matching_nodes(nodes: list[dict[str, Any]], placement: Mapping[str, str] | None) -> list[dict[str, Any]]:
    """The nodes that carry every label of ``placement`` (all of them for none)."""
    wanted = dict(placement or {})
    return [n for n in nodes if all(n["labels"].get(k) == v for k, v in wanted.items())]


def describe_labels(nodes: list[dict[str, Any]]) -> str:
    """'site=onprem (1 node), gpu=h100 (2 nodes)', or 'none'."""
    counts = collections.Counter(f"{k}={v}" for n in nodes for k, v in n["labels"].items())
    return ", ".join(f"{lv} ({c} node{'s' if c > 1 else ''})" for lv, c in sorted(counts.items())) or "none"


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


# --------------------------------------------------------------------------------------------- the actor

# Started between the actor and the rank's command on Linux: the command gets SIGKILL when the thread of
# the actor that started it ends (an actor killed while its rank runs leaves no orphan).
_DIE_WITH_PARENT = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class _RankProcess:
    """Ray actor (threaded): runs one rank's command and keeps its output lines until polled."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        self._rc: int | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        if self._proc is not None:
            raise RuntimeError("this actor already runs a rank")
        if not os.path.isdir(cwd):
            import ray

            raise RayLaunchError(
                f"directory {cwd} does not exist on node {ray.util.get_node_ip_address()} "
                f"({socket.gethostname()}): the run directory must be on a filesystem every node sees "
                "under the same path (NFS across machines)"
            )
        argv = list(argv)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the Python this node's Ray runs, with gpuforge installed
        # the node's own environment cut to the allow-list (a Ray node may hold its operator's secrets),
        # then what the launcher sent on purpose
        full_env = child_environment(env)
        threading.Thread(target=self._run, args=(argv, full_env, cwd), daemon=True).start()
        self._started.wait()
        if self._start_error is not None:
            raise RayLaunchError(f"cannot start {argv[0]!r}: {self._start_error}")
        assert self._proc is not None
        return self._proc.pid

    def _run(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        # This thread starts the process and lives until the output ends, which is after the process ended:
        # the death signal set in the child fires when the thread that forked it ends.
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
        try:
            self._proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,  # its own process group: signals reach the rank's children too
            )
        except OSError as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        threading.Thread(target=self._reap, daemon=True).start()
        assert self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            with self._cond:
                self._lines.append(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _reap(self) -> None:
        assert self._proc is not None
        rc = self._proc.wait()
        # The rank is over: children of it still holding the output pipe open would keep the rank "running".
        with contextlib.suppress(OSError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with self._cond:
            self._rc = rc
            self._cond.notify_all()

    def poll(self, wait_s: float) -> tuple[list[str], bool, int | None]:
        """``(lines, finished, exit code)``: waits up to ``wait_s`` for a line or the end."""
        with self._cond:
            if not self._lines and not (self._eof and self._rc is not None):
                self._cond.wait(wait_s)
            n = min(len(self._lines), _MAX_LINES)
            lines = [self._lines.popleft() for _ in range(n)]
            finished = self._eof and self._rc is not None and not self._lines
            return lines, finished, self._rc if finished else None

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM to the rank's process group, SIGKILL after ``grace_s``; its exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


# --------------------------------------------------------------------------------------------- the driver


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


def _rank_resources(
    world_size: int, resources_per_rank: Mapping[str, float] | Sequence[Mapping[str, float]] | None
) -> list[dict[str, float]]:
    if resources_per_rank is None:
        return [{} for _ in range(world_size)]
    if isinstance(resources_per_rank, Mapping):
        return [dict(resources_per_rank) for _ in range(world_size)]
    per = [dict(r) for r in resources_per_rank]
    if len(per) != world_size:
        raise ValueError(f"resources_per_rank has {len(per)} entries for {world_size} ranks")
    return per


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
    resources (see :func:`node_labels`). Raises :class:`RayLaunchError` when the cluster cannot hold the
    job (no node matches ``placement``, or the matching ones are too small), or a rank cannot be started.
    """
    ray = _ray()
    from ray.util.placement_group import placement_group

    if not ray.is_initialized():
        raise RayLaunchError("not connected to a Ray cluster: call connect(address) first")
    per_rank = _checked_resources(
        argv, world_size, strategy, cpus_per_rank, gpus_per_rank, resources_per_rank
    )
    nodes = cluster_nodes()
    selector, label_asks = _placement_constraint(placement, nodes)
    per_rank = [{**res, **label_asks} for res in per_rank]
    _check_fits(world_size, cpus_per_rank, gpus_per_rank, per_rank, nodes, placement)

    t0 = time.monotonic()
    run_dir = Path(run_dir).resolve()
    logs_dir = run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    workdir = str(Path(cwd).resolve() if cwd is not None else run_dir)
    stop = stop if stop is not None else threading.Event()

    bundles = [_bundle(cpus_per_rank, gpus_per_rank, res) for res in per_rank]
    if selector is None:
        pg = placement_group(bundles, strategy=strategy)
    else:  # every bundle, so every rank's actor, on a node whose labels match
        pg = placement_group(bundles, strategy=strategy, bundle_label_selector=[selector] * len(bundles))
    # By value: a worker then does not import gpuforge.distributed (and torch, seconds) to host the actor.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors: list[Any] = []
    finished = [False] * world_size
    result = RanksResult(exit_codes=[None] * world_size)
    files = []
    watched = False
    try:
        labelled = ", ".join(f"{k}={v}" for k, v in (placement or {}).items())
        on = f", on nodes labelled {labelled}" if labelled else ""
        what = f"{world_size} ranks ({bundles[0]} each, strategy {strategy}{on})"
        if not _wait_for_placement(ray, pg, stop, t0, placement_timeout_s, what):
            result.stopped = True  # stopped while waiting for room: no rank ever ran
            result.seconds = time.monotonic() - t0
            return result
        _place_actors(ray, pg, cpus_per_rank, gpus_per_rank, per_rank, actors)
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
    per_rank = _rank_resources(world_size, resources_per_rank)
    if cpus_per_rank <= 0 and gpus_per_rank <= 0 and not any(per_rank):
        raise ValueError(
            "each rank must ask for some resource (cpus_per_rank, gpus_per_rank or a custom one)"
        )
    return per_rank


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """One rank's placement-group bundle; Ray refuses zero amounts, so they are left out."""
    b = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in resources.items()}}
    return {k: v for k, v in b.items() if v > 0}


def _wait_for_placement(
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

    actor_cls = ray.remote(_RankProcess)
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
