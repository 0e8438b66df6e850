"""The scheduling rules on small queues: order, gangs, no starvation, impossible asks."""

import pytest

from gpuforge.scheduler.allocator import DeviceInfo, inventory, job_environment
from gpuforge.scheduler.queue import QueuedJob, plan_starts, queue_order

GPUS = {"cuda": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}
TOTAL = {"cuda": 4, "cpu": 1}


def test_higher_priority_first_then_first_submitted():
    jobs = [
        QueuedJob(1, 0, "cuda"),
        QueuedJob(2, 5, "cuda"),
        QueuedJob(3, 5, "cuda"),
        QueuedJob(4, -1, "cuda"),
    ]
    assert [j.id for j in queue_order(jobs)] == [2, 3, 1, 4]
    plan = plan_starts(jobs, {"cuda": ["cuda:0", "cuda:1"]}, TOTAL)
    assert plan.starts == [(2, ["cuda:0"]), (3, ["cuda:1"])] and plan.blocked == {"cuda": 1}


def test_a_gang_starts_only_with_all_its_devices():
    jobs = [QueuedJob(1, 0, "cuda", devices=3)]
    assert plan_starts(jobs, {"cuda": ["cuda:1", "cuda:2"]}, TOTAL).starts == []
    assert plan_starts(jobs, {"cuda": ["cuda:0", "cuda:2", "cuda:3"]}, TOTAL).starts == [
        (1, ["cuda:0", "cuda:2", "cuda:3"])
    ]


def test_small_low_priority_jobs_do_not_starve_a_big_one_but_other_device_types_go_on():
    big = QueuedJob(1, 10, "cuda", devices=4)
    small = [QueuedJob(i, 0, "cuda") for i in range(2, 6)]
    cpu = QueuedJob(6, 0, "cpu")
    plan = plan_starts([big, *small, cpu], {"cuda": ["cuda:3"], "cpu": ["cpu:0"]}, TOTAL)
    assert plan.starts == [(6, ["cpu:0"])]  # the free GPU waits for the big job
    assert plan.blocked == {"cuda": 1}
    plan = plan_starts([big, *small], GPUS, TOTAL)
    assert plan.starts == [(1, GPUS["cuda"])]


def test_a_job_asking_for_more_than_exists_is_impossible_and_holds_nobody_back():
    jobs = [QueuedJob(1, 5, "cuda", devices=8), QueuedJob(2, 0, "cuda"), QueuedJob(3, 0, "tpu")]
    plan = plan_starts(jobs, GPUS, TOTAL)
    assert plan.impossible == {
        1: "asks for 8 cuda device(s); this server has 4",
        3: "asks for 1 tpu device(s); this server has 0",
    }
    assert plan.starts == [(2, ["cuda:0"])]


@pytest.mark.parametrize("slots", [1, 2])
def test_the_cpu_is_cut_into_slots_and_a_cpu_job_sees_no_gpu(slots):
    cpus = [d for d in inventory(cpu_slots=slots) if d.kind == "cpu"]
    assert [d.id for d in cpus] == [f"cpu:{i}" for i in range(slots)]
    env = job_environment(cpus[:1])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and int(env["OMP_NUM_THREADS"]) == cpus[0].threads >= 1


def test_a_gpu_job_sees_its_own_gpus_only():
    gpus = [DeviceInfo("cuda:2", "cuda", "H200"), DeviceInfo("cuda:5", "cuda", "H200")]
    assert job_environment(gpus) == {"CUDA_VISIBLE_DEVICES": "2,5"}


def test_a_job_held_by_its_owners_max_running_is_skipped_not_a_barrier():
    first = QueuedJob(1, 10, "cuda", devices=4, owner=7)  # highest priority, all the GPUs: its owner is full
    others = [QueuedJob(2, 0, "cuda", owner=8), QueuedJob(3, 0, "cuda", owner=9)]
    plan = plan_starts([first, *others], GPUS, TOTAL, running={7: 2}, max_running={7: 2})
    assert plan.starts == [(2, ["cuda:0"]), (3, ["cuda:1"])]  # not held back behind it
    assert plan.blocked == {}
    assert plan.held == {1: "waiting for quota max_running: its key runs 2 jobs, its limit"}
    # once one of its owner's jobs ends, it starts at its turn: first, ahead of the others
    plan = plan_starts([first, *others], GPUS, TOTAL, running={7: 1}, max_running={7: 2})
    assert plan.starts == [(1, GPUS["cuda"])] and plan.held == {}


def test_max_running_counts_the_jobs_started_in_the_same_plan_and_owners_without_one_are_free():
    jobs = [QueuedJob(i, 0, "cuda", owner=7) for i in (1, 2, 3)] + [QueuedJob(4, 0, "cuda", owner=8)]
    plan = plan_starts(jobs, GPUS, TOTAL, running={7: 1}, max_running={7: 2})
    assert plan.starts == [(1, ["cuda:0"]), (4, ["cuda:1"])]
    assert set(plan.held) == {2, 3}
    assert len(plan_starts(jobs, GPUS, TOTAL, running={7: 1}).starts) == 4  # no limits: none held


def test_fair_share_keys_take_turns_the_least_used_first_and_priority_still_rules():
    a = [QueuedJob(i, 0, "cuda", owner=1) for i in (1, 2, 3)]  # key 1 queued three
    b = QueuedJob(4, 0, "cuda", owner=2)  # then key 2 one
    urgent = QueuedJob(5, 9, "cuda", owner=1)
    assert [j.id for j in queue_order([*a, b])] == [1, 4, 2, 3]  # 2's single job waits one turn, not three
    # within a turn, the key that used less lately goes first
    assert [j.id for j in queue_order([*a, b], usage={1: 3600.0, 2: 60.0})] == [4, 1, 2, 3]
    # a share of 2 halves a key's usage and doubles its turns
    b2 = QueuedJob(6, 0, "cuda", owner=2)
    assert [j.id for j in queue_order([*a, b, b2])] == [1, 4, 2, 6, 3]
    assert [j.id for j in queue_order([*a, b, b2], shares={1: 2.0})] == [1, 4, 2, 3, 6]
    assert [j.id for j in queue_order([*a, b, urgent], usage={1: 1e9})][0] == 5  # priority first
    plan = plan_starts([*a, b], {"cuda": ["cuda:0", "cuda:1"]}, TOTAL, usage={1: 3600.0})
    assert plan.starts == [(4, ["cuda:0"]), (1, ["cuda:1"])]
