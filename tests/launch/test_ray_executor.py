"""`gpuforge server --executor ray`: a real two-node local Ray cluster (one CPU a node), a real server
process; a data-parallel job's two ranks land one on each node, their output flows back into the run
directory, and a plain job runs there too. A cluster that does not answer stops the server at start."""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from gpuforge.runs import RunDir  # noqa: E402
from gpuforge.runtime.host import free_port  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.ddp_specs import write_ddp_spec as write_spec  # noqa: E402

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

MB = 1024 * 1024


@pytest.fixture
def two_nodes(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 80 * MB, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_jobs_run_on_the_ray_cluster_one_rank_a_node(tmp_path, monkeypatch, two_nodes):
    ddp = write_spec(tmp_path, "across", train={"max_steps": 6})
    plain = write_spec(
        tmp_path, "plain", train={"max_steps": 4}, resources={"devices": 1}, distributed={"strategy": "none"}
    )
    server = LocalServer(
        tmp_path / "home",
        log=tmp_path / "server.log",
        GPUFORGE_DATA_ROOTS=str(tmp_path),
        GPUFORGE_EXECUTOR="ray",
        GPUFORGE_RAY_ADDRESS=two_nodes.address,
    )
    with server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        ids = [json.loads(run_cli("submit", str(spec), "--json").stdout)["id"] for spec in (ddp, plain)]
        for job_id in ids:
            waited = run_cli("wait", str(job_id), timeout=300)
            assert waited.returncode == 0, waited.stdout + waited.stderr
        jobs = [json.loads(run_cli("job", str(i), "--json").stdout) for i in ids]
        too_many = run_cli("submit", str(write_spec(tmp_path, "big", resources={"devices": 3})))
    log = (tmp_path / "server.log").read_text()
    assert [j["state"] for j in jobs] == ["finished", "finished"], log[-3000:]
    # the cluster's two CPUs are the server's two slots: a job asking three is refused with that
    assert too_many.returncode == 2 and "this server has 2 (cpu:0, cpu:1" in too_many.stderr

    run = RunDir(jobs[0]["run_dir"])
    assert run.summary()["processes"] == 2
    assert [m["step"] for m in run.metrics()] == list(range(1, 7))
    for rank in (0, 1):  # each rank's output, streamed back by the driver
        assert "gpuforge.train" in (run.logs_dir / f"rank{rank}.log").read_text()
    assert "on 2 nodes" in (run.logs_dir / "process.log").read_text()
    assert RunDir(jobs[1]["run_dir"]).summary()["processes"] == 1


def test_a_ray_address_that_does_not_answer_stops_the_server_at_start(tmp_path):
    env = {**os.environ, "GPUFORGE_HOME": str(tmp_path / "home")}
    done = run_cli(
        "server",
        "--executor",
        "ray",
        "--ray-address",
        f"127.0.0.1:{free_port()}",
        "--port",
        "0",
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no Ray cluster answers at 127.0.0.1:" in done.stderr
