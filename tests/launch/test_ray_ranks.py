"""gpuforge.launch.ray_ranks, and ray_cluster's connect and devices, on a real local Ray cluster of two nodes,
with gloo ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from gpuforge.launch.ray_cluster import RayLaunchError, cluster_devices, connect  # noqa: E402
from gpuforge.launch.ray_ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

PROBE = Path(__file__).resolve().parent / "ray_rank_probe.py"
MB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED",)}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1, "rank_slot": 1},
            "object_store_memory": 80 * MB,
            "include_dashboard": False,
        },
    )
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1, "rank_slot": 1}, object_store_memory=80 * MB)
        c.wait_for_nodes()
        connect(c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _probes(run_dir: Path, rank: int) -> list[dict]:
    text = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return [json.loads(line[len("probe ") :]) for line in text.splitlines() if line.startswith("probe ")]


def _node_ids(c: Cluster) -> tuple[str, str]:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    a = next(n["NodeID"] for n in nodes if "node_a" in n["Resources"])
    b = next(n["NodeID"] for n in nodes if "node_b" in n["Resources"])
    return a, b


def _assert_cluster_whole() -> None:
    """The job's actors and placement group are gone: every node's resources are free again."""
    deadline = time.monotonic() + 20
    free = ray.available_resources()
    while (free.get("rank_slot", 0) < 2 or free.get("CPU", 0) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
        free = ray.available_resources()
    assert free.get("rank_slot", 0) == 2 and free.get("CPU", 0) == 2, free


def test_cluster_devices(cluster):
    d = cluster_devices()
    assert d["nodes"] == 2 and d["cpus"] == 2 and d["gpus"] == 0
    with pytest.raises(RayLaunchError, match="GPU"):
        run_ranks([sys.executable, str(PROBE)], 2, Path("/nonexistent-unused"), gpus_per_rank=1)


def test_two_ranks_pinned_one_per_node(cluster, tmp_path):
    a, b = _node_ids(cluster)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    seen: list[tuple[int, str]] = []
    res = run_ranks(
        ["python", str(PROBE)],
        2,
        run_dir,
        resources_per_rank=[{"node_a": 1}, {"node_b": 1}],  # rank 0 on the head, rank 1 on the worker node
        timeout_s=120,
        on_line=lambda r, line: seen.append((r, line)),
    )
    assert res.exit_codes == [0, 0] and res.ok, res
    assert not res.stopped and not res.timed_out and res.failed_rank is None
    assert res.node_ids == [a, b]
    for r in (0, 1):
        (p,) = _probes(run_dir, r)
        assert p["rank"] == r and p["world"] == 2 and p["sum"] == 3.0  # 1 + 2
        assert p["local_rank"] == 0 and p["local_world_size"] == 1
        assert p["master"] == f"{res.master_addr}:{res.master_port}"
        assert p["cwd"] == str(run_dir.resolve())
        assert f"stderr line from rank {r}" in (run_dir / "logs" / f"rank{r}.log").read_text()
    assert {r for r, line in seen if line.startswith("probe ")} == {0, 1}


def test_failed_rank_stops_the_others(cluster, tmp_path):
    t0 = time.monotonic()
    res = run_ranks(
        ["python", str(PROBE), "--fail-rank", "1", "--exit-code", "3"],
        2,
        tmp_path,
        resources_per_rank={"rank_slot": 1},
        grace_s=5,
        timeout_s=120,
    )
    took = time.monotonic() - t0
    assert len(set(res.node_ids)) == 2  # one rank_slot on each node: one rank on each
    assert res.exit_codes[1] == 3 and res.failed_rank == 1
    assert res.exit_codes[0] == -15  # it slept in place of hanging in a collective: SIGTERM ended it
    assert not res.ok and not res.stopped and not res.timed_out
    assert took < 60, took
    assert "rank 1 fails with 3" in (tmp_path / "logs" / "rank1.log").read_text()
    _assert_cluster_whole()


def test_stop_event_terminates_then_kills(cluster, tmp_path):
    stop = threading.Event()
    waiting: set[int] = set()

    def on_line(r: int, line: str) -> None:
        if line == "waiting":
            waiting.add(r)
            if len(waiting) == 2:
                stop.set()  # what the caller's SIGTERM/SIGINT handler does

    t0 = time.monotonic()
    res = run_ranks(
        ["python", str(PROBE), "--wait", "--ignore-term", "1"],
        2,
        tmp_path,
        resources_per_rank={"rank_slot": 1},
        stop=stop,
        grace_s=2,
        timeout_s=120,
        on_line=on_line,
    )
    assert waiting == {0, 1}
    assert res.stopped and res.failed_rank is None
    assert res.exit_codes == [-15, -9], res  # rank 1 ignored SIGTERM: SIGKILL after the grace
    assert time.monotonic() - t0 < 60


def test_timeout_stops_the_job(cluster, tmp_path):
    res = run_ranks(
        ["python", str(PROBE), "--wait"],
        2,
        tmp_path,
        resources_per_rank={"rank_slot": 1},
        grace_s=2,
        timeout_s=4,
    )
    assert res.timed_out and res.exit_codes == [-15, -15]
    _assert_cluster_whole()


def test_unplaceable_job_times_out_or_stops(cluster, tmp_path):
    # two rank_slots in all, but one per node: STRICT_PACK (all on one node) can never be placed
    ask = dict(resources_per_rank={"rank_slot": 1}, strategy="STRICT_PACK")
    with pytest.raises(RayLaunchError, match="could not place"):
        run_ranks(["python", str(PROBE)], 2, tmp_path, placement_timeout_s=2, **ask)
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    res = run_ranks(["python", str(PROBE)], 2, tmp_path, stop=stop, **ask)
    assert res.stopped and res.exit_codes == [None, None] and not res.ok
    _assert_cluster_whole()


def test_missing_run_dir_on_node_is_a_clear_error(cluster, tmp_path):
    with pytest.raises(RayLaunchError, match="every node sees"):
        run_ranks(["python", str(PROBE)], 1, tmp_path, cwd=tmp_path / "not-there", timeout_s=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect_in_fresh_process(addresses: list[str], timeout_s: float) -> list[tuple[str, float]]:
    """connect() to each address in a process of its own (this one is connected to the test cluster)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from gpuforge.launch.ray_cluster import RayLaunchError, connect
        from gpuforge.errors import GpuforgeError
        for address in {addresses!r}:
            t0 = time.monotonic()
            try:
                connect(address, timeout_s={timeout_s!r})
            except RayLaunchError as e:
                assert isinstance(e, GpuforgeError)
                print("ERROR", time.monotonic() - t0, e, flush=True)
            else:
                print("CONNECTED", flush=True)
                sys.exit(1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 0 and len(lines) == len(addresses), proc.stdout + proc.stderr[-3000:]
    return [(line.split(" ", 2)[2], float(line.split(" ", 2)[1])) for line in lines]


def test_connect_errors_are_clear_and_bounded():
    """Nothing listens: refused at once. Something that is not Ray listens: Ray alone would retry for
    about 14 minutes (20 tries of ~41 s); connect gives up within about its timeout."""
    with socket.socket() as srv:
        srv.bind(("0.0.0.0", 0))
        srv.listen()
        not_ray = f"127.0.0.1:{srv.getsockname()[1]}"
        nothing = f"127.0.0.1:{_free_port()}"
        (m1, s1), (m2, s2) = _connect_in_fresh_process([nothing, not_ray], timeout_s=8)
    assert nothing in m1 and "no Ray cluster answers" in m1 and "ray start --head" in m1
    assert s1 < 2, s1
    assert not_ray in m2 and "cannot connect to the Ray cluster" in m2 and "ray start --head" in m2
    assert s2 < 12, s2
