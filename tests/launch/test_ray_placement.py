"""Placement on labelled Ray nodes, on a real two-node local Ray cluster (one CPU a node): the head labelled
gpu=h100 by a custom resource (``label:gpu=h100``), the other node site=onprem by a Ray node label. The
server's devices carry their node's labels; a job's ranks run only on nodes whose labels match its
``resources.placement``; a placement no node carries is refused (at submit through the server, naming the
labels that exist); a job without placement still runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from gpuforge.launch.ray_cluster import RayLaunchError, cluster_devices, connect  # noqa: E402
from gpuforge.launch.ray_ranks import run_ranks  # noqa: E402
from gpuforge.runs import RunDir  # noqa: E402
from gpuforge.scheduler.allocator import cluster_inventory  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.ddp_specs import write_ddp_spec  # noqa: E402

pytestmark = pytest.mark.slow

PROBE = Path(__file__).resolve().parent / "ray_rank_probe.py"
MB = 1024 * 1024


@pytest.fixture(scope="module")
def cluster():
    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"label:gpu=h100": 1},  # a label as a custom resource (any Ray version)
            "object_store_memory": 80 * MB,
            "include_dashboard": False,
        },
    )
    try:
        c.add_node(num_cpus=1, labels={"site": "onprem"}, object_store_memory=80 * MB)
        c.wait_for_nodes()
        connect(c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


def _node_ids() -> dict[str, str]:
    """'head' and 'onprem': the node id of each."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    return {
        "head": next(n["NodeID"] for n in nodes if "label:gpu=h100" in n["Resources"]),
        "onprem": next(n["NodeID"] for n in nodes if n.get("Labels", {}).get("site") == "onprem"),
    }


def test_devices_carry_their_nodes_labels(cluster):
    ids = _node_ids()
    devices = cluster_inventory(cluster_devices())
    assert sorted(d.id for d in devices) == ["cpu:0", "cpu:1"]
    by_labels = {d.labels: d for d in devices}
    assert set(by_labels) == {(("gpu", "h100"),), (("site", "onprem"),)}  # Ray's own (ray.io/...) left out
    assert ids["onprem"][:8] in by_labels[(("site", "onprem"),)].name
    assert ids["head"][:8] in by_labels[(("gpu", "h100"),)].name


def test_ranks_run_only_on_nodes_whose_labels_match(cluster, tmp_path):
    ids = _node_ids()
    # two ranks of half a CPU, SPREAD: without a placement Ray would put one on each node
    for placement, node in (({"gpu": "h100"}, "head"), ({"site": "onprem"}, "onprem")):
        run_dir = tmp_path / node
        res = run_ranks(
            ["python", str(PROBE)], 2, run_dir, cpus_per_rank=0.5, strategy="SPREAD", placement=placement
        )
        assert res.ok and res.node_ids == [ids[node], ids[node]], (placement, res)
        for r in (0, 1):
            probe = [
                x
                for x in (run_dir / "logs" / f"rank{r}.log").read_text().splitlines()
                if x.startswith("probe")
            ]
            assert json.loads(probe[0][len("probe ") :])["sum"] == 3.0  # they met: 1 + 2

    # refused before any rank starts: no node carries the label, or those that do are too small
    with pytest.raises(
        RayLaunchError, match=r"no alive node .* labelled site=cloud; .*gpu=h100 \(1 node\), "
    ):
        run_ranks([sys.executable, str(PROBE)], 1, tmp_path, placement={"site": "cloud"})
    with pytest.raises(RayLaunchError, match=r"nodes labelled site=onprem have \(1 nodes, 1 CPUs"):
        run_ranks([sys.executable, str(PROBE)], 2, tmp_path, placement={"site": "onprem"})


def test_the_server_runs_placed_jobs_on_their_nodes_and_refuses_what_no_node_carries(
    tmp_path, monkeypatch, cluster
):
    ids = _node_ids()
    one = {"resources": {"devices": 1}, "distributed": {"strategy": "none"}, "train": {"max_steps": 3}}
    placed = write_ddp_spec(
        tmp_path, "placed", **{**one, "resources": {"devices": 1, "placement": {"site": "onprem"}}}
    )
    anywhere = write_ddp_spec(tmp_path, "anywhere", **one)
    cloud = write_ddp_spec(
        tmp_path, "cloud", **{**one, "resources": {"devices": 1, "placement": {"site": "cloud"}}}
    )
    two = write_ddp_spec(tmp_path, "two", resources={"devices": 2, "placement": {"site": "onprem"}})
    server = LocalServer(
        tmp_path / "home",
        log=tmp_path / "server.log",
        GPUFORGE_DATA_ROOTS=str(tmp_path),
        GPUFORGE_EXECUTOR="ray",
        GPUFORGE_RAY_ADDRESS=cluster.address,
    )
    with server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        refused = [run_cli("submit", str(spec)) for spec in (cloud, two)]
        job_ids = [json.loads(run_cli("submit", str(s), "--json").stdout)["id"] for s in (placed, anywhere)]
        for job_id in job_ids:
            waited = run_cli("wait", str(job_id), timeout=240)
            assert waited.returncode == 0, waited.stdout + waited.stderr
        jobs = [json.loads(run_cli("job", str(i), "--json").stdout) for i in job_ids]
    log = (tmp_path / "server.log").read_text()
    assert [j["state"] for j in jobs] == ["finished", "finished"], log[-3000:]

    assert refused[0].returncode == 2
    assert "labelled site=cloud asked for; this server has 0" in refused[0].stderr
    assert "gpu=h100, site=onprem" in refused[0].stderr  # the labels that exist
    assert (
        refused[1].returncode == 2
        and "labelled site=onprem asked for; this server has 1" in refused[1].stderr
    )

    placed_log = " ".join((RunDir(jobs[0]["run_dir"]).logs_dir / "process.log").read_text().split())
    assert "ran on 1 nodes (" in placed_log and f"node {ids['onprem']})" in placed_log, placed_log[-2000:]
    assert RunDir(jobs[1]["run_dir"]).summary()["processes"] == 1  # no placement: anywhere, as before
