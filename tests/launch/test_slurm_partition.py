"""A Slurm partition as the server sees it (launch/slurm_partition.py), on the tests' one-node cluster:
its nodes' CPUs and GPUs from sinfo, a partition Slurm does not have, and the probe job that writes into
the run directory from a node."""

from __future__ import annotations

import os

import pytest

from gpuforge.errors import GpuforgeError
from gpuforge.launch import slurm_partition
from tests.helpers.slurm import slurm_conf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def conf() -> str:
    return slurm_conf()


def test_the_partitions_nodes_and_a_partition_slurm_does_not_have(conf, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", conf)
    assert slurm_partition.default_partition() == "debug"
    nodes = slurm_partition.partition_nodes(None)
    assert [(n["cpus"], n["gpus"]) for n in nodes] == [(len(os.sched_getaffinity(0)), 0)]
    assert nodes[0]["where"].startswith("Slurm node ")
    with pytest.raises(GpuforgeError, match=r"Slurm has no partition gpu \(partitions: debug\)"):
        slurm_partition.partition_nodes("gpu")


def test_a_probe_job_writes_into_the_folder_from_a_node_and_leaves_nothing_there(conf, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", conf)
    node = slurm_partition.probe_shared(tmp_path / "runs", {"partition": "debug"})
    assert node and list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize(
    "gres, gpus",
    [("(null)", 0), ("gpu:4", 4), ("gpu:a100:4(S:0-1),gpu:v100:2", 6), ("gpu:2,mps:100", 2), ("mps:100", 0)],
)
def test_a_nodes_gpus_from_its_gres_as_sinfo_prints_it(gres, gpus):
    assert slurm_partition.gres_gpus(gres) == gpus
