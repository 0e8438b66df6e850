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
    assert [(n["cpus"], n["gpus"]) for n in nodes] == [(os.cpu_count(), 0)]
    assert nodes[0]["where"].startswith("Slurm node ")
    with pytest.raises(GpuforgeError, match=r"Slurm has no partition gpu \(partitions: debug\)"):
        slurm_partition.partition_nodes("gpu")


def test_a_probe_job_writes_into_the_folder_from_a_node_and_leaves_nothing_there(conf, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", conf)
    node = slurm_partition.probe_shared(tmp_path / "runs", {"partition": "debug"})
    assert node and list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize(
    "gres, state, gpus, usable",
    [
        ("(null)", "idle", 0, True),
        ("gpu:4", "mix", 4, True),
        ("gpu:a100:4(S:0-1),gpu:v100:2", "alloc", 6, True),
        ("gpu:2,mps:100", "idle~", 2, True),  # powered down: Slurm powers it up for a job
        ("gpu:8", "drain", 8, False),
        ("gpu:8", "idle*", 8, False),  # not responding
        ("gpu:8", "down", 8, False),
    ],
)
def test_gres_and_node_states_as_sinfo_prints_them(gres, state, gpus, usable):
    assert sum(int(n) for n in slurm_partition._GPUS.findall(gres)) == gpus
    assert slurm_partition._usable(state) is usable
