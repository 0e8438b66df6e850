"""The scheduling rules on small queues: order, gangs, no starvation, impossible asks, limits, fair share by
project, preemption, backfill and placement (queue.py's docstring states them)."""

import pytest

from gpuforge.scheduler.allocator import DeviceInfo, inventory, job_environment
from gpuforge.scheduler.queue import Fairness, Limits, QueuedJob, RunningJob, plan_starts, queue_order

GPUS = {"cuda": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}
TOTAL = {"cuda": 4, "cpu": 1}  # a server without labels may give counts: ids are then cuda:0..3
ONPREM, CLOUD = (("site", "onprem"),), (("site", "cloud"),)
LABELS = {"cuda:0": ONPREM, "cuda:1": ONPREM, "cuda:2": CLOUD, "cuda:3": CLOUD}


def ids(jobs) -> list[int]:
    return [j.id for j in jobs]


def running(job_id, device_ids, priority=0, **kw) -> RunningJob:
    return RunningJob(job_id, priority, "cuda", tuple(device_ids), **kw)


# --- order, gangs, no starvation, impossible asks ---------------------------------------------------------


def test_higher_priority_first_then_first_submitted():
    jobs = [
        QueuedJob(1, 0, "cuda"),
        QueuedJob(2, 5, "cuda"),
        QueuedJob(3, 5, "cuda"),
        QueuedJob(4, -1, "cuda"),
    ]
    assert ids(queue_order(jobs)) == [2, 3, 1, 4]
    plan = plan_starts(jobs, {"cuda": ["cuda:0", "cuda:1"]}, TOTAL)
    assert plan.starts == [(2, ["cuda:0"]), (3, ["cuda:1"])]
    assert plan.order == [2, 3, 1, 4]
    # the first job that cannot start says why; the one behind it just waits its turn
    assert plan.blocked == {1: "waiting for 1 cuda device(s) (0 free)"}


def test_a_gang_starts_only_with_all_its_devices():
    jobs = [QueuedJob(1, 0, "cuda", devices=3)]
    assert plan_starts(jobs, {"cuda": ["cuda:1", "cuda:2"]}, TOTAL).starts == []
    assert plan_starts(jobs, {"cuda": ["cuda:0", "cuda:2", "cuda:3"]}, GPUS).starts == [
        (1, ["cuda:0", "cuda:2", "cuda:3"])
    ]


def test_small_low_priority_jobs_do_not_starve_a_big_one_but_other_device_types_go_on():
    big = QueuedJob(1, 10, "cuda", devices=4)
    small = [QueuedJob(i, 0, "cuda") for i in range(2, 6)]
    cpu = QueuedJob(6, 0, "cpu")
    plan = plan_starts([big, *small, cpu], {"cuda": ["cuda:3"], "cpu": ["cpu:0"]}, TOTAL)
    assert plan.starts == [(6, ["cpu:0"])]  # the free GPU waits for the big job
    assert list(plan.blocked) == [1] and plan.backfilled == []
    plan = plan_starts([big, *small], GPUS, TOTAL)
    assert plan.starts == [(1, GPUS["cuda"])]


def test_a_job_asking_for_more_than_exists_is_impossible_and_holds_nobody_back():
    jobs = [QueuedJob(1, 5, "cuda", devices=8), QueuedJob(2, 0, "cuda"), QueuedJob(3, 0, "tpu")]
    plan = plan_starts(jobs, GPUS, TOTAL)
    assert plan.impossible == {
        1: "asks for 8 cuda device(s); this server has 4",
        3: "asks for 1 tpu device(s); this server has 0",
    }
    assert plan.starts == [(2, ["cuda:0"])] and plan.blocked == {}


@pytest.mark.parametrize("slots", [1, 2])
def test_the_cpu_is_cut_into_slots_and_a_cpu_job_sees_no_gpu(slots):
    cpus = [d for d in inventory(cpu_slots=slots) if d.kind == "cpu"]
    assert [d.id for d in cpus] == [f"cpu:{i}" for i in range(slots)]
    env = job_environment(cpus[:1])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and int(env["OMP_NUM_THREADS"]) == cpus[0].threads >= 1


def test_a_gpu_job_sees_its_own_gpus_only():
    gpus = [DeviceInfo("cuda:2", "cuda", "H200"), DeviceInfo("cuda:5", "cuda", "H200")]
    assert job_environment(gpus) == {"CUDA_VISIBLE_DEVICES": "2,5"}


# --- limits: held, never a barrier ------------------------------------------------------------------------


def test_a_job_held_by_its_owners_max_running_is_skipped_not_a_barrier():
    first = QueuedJob(1, 10, "cuda", devices=4, owner=7)  # highest priority, all the GPUs: its owner is full
    others = [QueuedJob(2, 0, "cuda", owner=8), QueuedJob(3, 0, "cuda", owner=9)]
    plan = plan_starts([first, *others], GPUS, TOTAL, Limits(running={7: 2}, max_running={7: 2}))
    assert plan.starts == [(2, ["cuda:0"]), (3, ["cuda:1"])]  # not held back behind it
    assert plan.blocked == {}
    assert plan.held == {1: "waiting for quota max_running: its key runs 2 jobs, its limit"}
    # once one of its owner's jobs ends, it starts at its turn: first, ahead of the others
    plan = plan_starts([first, *others], GPUS, TOTAL, Limits(running={7: 1}, max_running={7: 2}))
    assert plan.starts == [(1, GPUS["cuda"])] and plan.held == {}


def test_max_running_counts_the_jobs_started_in_the_same_plan_and_owners_without_one_are_free():
    jobs = [QueuedJob(i, 0, "cuda", owner=7) for i in (1, 2, 3)] + [QueuedJob(4, 0, "cuda", owner=8)]
    plan = plan_starts(jobs, GPUS, TOTAL, Limits(running={7: 1}, max_running={7: 2}))
    assert plan.starts == [(1, ["cuda:0"]), (4, ["cuda:1"])]
    assert set(plan.held) == {2, 3}
    assert len(plan_starts(jobs, GPUS, TOTAL, Limits(running={7: 1})).starts) == 4  # no limits: none held


def test_a_project_at_its_max_devices_is_held_with_why_and_counts_what_it_starts_now():
    limits = Limits(project_devices={10: 2}, max_devices={10: 3}, names={10: "vision"})
    jobs = [QueuedJob(1, 5, "cuda", devices=2, project=10), QueuedJob(2, 0, "cuda", project=20)]
    plan = plan_starts(jobs, GPUS, TOTAL, limits)
    assert plan.held == {1: "waiting for project vision's max_devices 3: it holds 2, this job asks for 2"}
    assert plan.starts == [(2, ["cuda:0"])]  # another project's job is not held back behind it
    # a 1-device job still fits under the cap; the next one of the same project in the same pass does not
    jobs = [QueuedJob(3, 0, "cuda", project=10), QueuedJob(4, 0, "cuda", project=10)]
    plan = plan_starts(jobs, GPUS, TOTAL, limits)
    assert plan.starts == [(3, ["cuda:0"])] and list(plan.held) == [4]
    assert "it holds 3, this job asks for 1" in plan.held[4]


def test_a_project_whose_budget_is_spent_is_held_and_holds_nobody_back():
    why = "project vision's budget of $100.00 for this month is spent"
    limits = Limits(spent={10: why})
    jobs = [QueuedJob(1, 9, "cuda", devices=4, project=10), QueuedJob(2, 0, "cuda", project=20)]
    plan = plan_starts(jobs, GPUS, TOTAL, limits)
    assert plan.held == {1: f"waiting: {why}"}
    assert plan.starts == [(2, ["cuda:0"])] and plan.blocked == {}
    assert plan.order == [1, 2]  # it keeps its place


# --- fair share -------------------------------------------------------------------------------------------


def test_fair_share_by_project_the_single_job_of_another_project_starts_second():
    a = [QueuedJob(i, 0, "cuda", owner=1, project=10) for i in (1, 2, 3)]  # project A queued three
    b = QueuedJob(4, 0, "cuda", owner=2, project=20)  # then project B one
    assert ids(queue_order([*a, b])) == [1, 4, 2, 3]
    assert plan_starts([*a, b], {"cuda": ["cuda:0", "cuda:1"]}, TOTAL).starts == [
        (1, ["cuda:0"]),
        (4, ["cuda:1"]),
    ]
    # many keys in A do not multiply its turns: the project takes turns, not the key
    a_many_keys = [QueuedJob(i, 0, "cuda", owner=i, project=10) for i in (1, 2, 3)]
    assert ids(queue_order([*a_many_keys, b])) == [1, 4, 2, 3]


def test_inside_a_project_its_keys_take_turns_the_least_used_first():
    jobs = [
        QueuedJob(1, 0, "cuda", owner=1, project=10),
        QueuedJob(2, 0, "cuda", owner=1, project=10),
        QueuedJob(3, 0, "cuda", owner=2, project=10),
    ]
    assert ids(queue_order(jobs)) == [1, 3, 2]
    assert ids(queue_order(jobs, Fairness(usage={1: 3600.0, 2: 60.0}))) == [3, 1, 2]


def test_shares_weigh_the_turns_of_a_project():
    a = [QueuedJob(i, 0, "cuda", project=10) for i in (1, 2, 3)]
    b = [QueuedJob(i, 0, "cuda", project=20) for i in (4, 5)]
    assert ids(queue_order([*a, *b])) == [1, 4, 2, 5, 3]
    assert ids(queue_order([*a, *b], Fairness(shares={10: 2.0}))) == [1, 4, 2, 3, 5]  # two turns per turn
    assert ids(queue_order([*a, *b], Fairness(shares={20: 0.5}))) == [1, 4, 2, 3, 5]  # half: a turn in two
    assert ids(queue_order([*a, *b], Fairness(shares={20: 0.25})))[-2:] == [3, 5]


def test_within_a_turn_the_project_that_used_least_lately_goes_first_over_its_share():
    a = [QueuedJob(i, 0, "cuda", owner=1, project=10) for i in (1, 2, 3)]
    b = QueuedJob(4, 0, "cuda", owner=2, project=20)
    used = Fairness(project_usage={10: 3600.0, 20: 60.0})
    assert ids(queue_order([*a, b], used)) == [4, 1, 2, 3]
    # a share of 100 makes A's hour weigh 36 s: less than B's minute
    weighed = Fairness(project_usage={10: 3600.0, 20: 60.0}, shares={10: 100.0})
    assert ids(queue_order([*a, b], weighed)) == [1, 4, 2, 3]
    # a key without a project is a project of its own: its own usage counts
    loner = QueuedJob(5, 0, "cuda", owner=3)
    assert ids(queue_order([*a, loner], Fairness(usage={3: 1e6})))[:2] == [1, 5]
    assert ids(queue_order([*a, loner], Fairness(usage={3: 1.0}, project_usage={10: 2.0})))[:2] == [5, 1]
    # priority still rules
    urgent = QueuedJob(6, 9, "cuda", owner=1, project=10)
    assert ids(queue_order([*a, b, urgent], Fairness(project_usage={10: 1e9})))[0] == 6
    plan = plan_starts([*a, b], {"cuda": ["cuda:0", "cuda:1"]}, TOTAL, fairness=used)
    assert plan.starts == [(4, ["cuda:0"]), (1, ["cuda:1"])]


# --- preemption -------------------------------------------------------------------------------------------


def test_preemption_takes_the_lowest_priority_then_the_fewest_jobs():
    urgent = QueuedJob(1, 5, "cuda", devices=2)
    # two 1-device jobs at priority 0 go before one 2-device job at priority 1
    busy = [running(101, ["cuda:0"]), running(102, ["cuda:1"]), running(103, ["cuda:2", "cuda:3"], 1)]
    plan = plan_starts([urgent], {"cuda": []}, GPUS, running=busy)
    assert plan.preempt == {101: 1, 102: 1} and plan.starts == []
    assert plan.blocked == {1: "waiting for 2 cuda device(s) (0 free); preempting job(s) 102, 101"}
    # at one priority, the fewest: the 2-device job alone
    busy = [running(101, ["cuda:0"]), running(102, ["cuda:1"]), running(103, ["cuda:2", "cuda:3"])]
    assert plan_starts([urgent], {"cuda": []}, GPUS, running=busy).preempt == {103: 1}
    # what is free counts: one more device needed, one job preempted (the newest of equals)
    plan = plan_starts([urgent], {"cuda": ["cuda:3"]}, GPUS, running=busy[:2])
    assert plan.preempt == {102: 1}


def test_a_gang_is_preempted_whole_and_what_is_being_freed_is_not_preempted_again():
    urgent = QueuedJob(1, 5, "cuda")
    gang = running(101, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    plan = plan_starts([urgent], {"cuda": []}, GPUS, running=[gang])
    assert plan.preempt == {101: 1}  # all four devices stop, though one is enough
    # the next pass: it is stopping; nothing more is preempted, the job waits for its devices
    stopping = running(101, gang.device_ids, stopping=True)
    other = running(102, ["cuda:3"])
    plan = plan_starts([urgent], {"cuda": []}, GPUS, running=[stopping])
    assert plan.preempt == {} and plan.blocked == {
        1: "waiting for 1 cuda device(s) (0 free); 4 held by job 101, stopping"
    }
    two = QueuedJob(1, 5, "cuda", devices=2)
    half = running(101, ["cuda:0", "cuda:1"], stopping=True)
    assert plan_starts([two], {"cuda": []}, GPUS, running=[half, other]).preempt == {}


def test_no_preemption_when_all_of_them_together_would_not_free_enough():
    urgent = QueuedJob(1, 5, "cuda", devices=4)
    busy = [running(101, ["cuda:0"]), running(102, ["cuda:1", "cuda:2"], preemptible=False)]
    plan = plan_starts([urgent], {"cuda": ["cuda:3"]}, GPUS, running=busy)
    assert plan.preempt == {}  # 1 free + 1 preemptible < 4: stopping job 101 would lose its work for nothing
    assert plan.blocked[1].startswith("waiting for 4 cuda device(s) (1 free); 1 held by job 101, preemptible")


def test_never_a_job_that_is_not_preemptible_stopping_or_of_equal_or_higher_priority():
    urgent = QueuedJob(1, 5, "cuda")
    for holder in (
        running(101, GPUS["cuda"], preemptible=False),
        running(101, GPUS["cuda"], priority=5),
        running(101, GPUS["cuda"], priority=7),
    ):
        assert plan_starts([urgent], {"cuda": []}, GPUS, running=[holder]).preempt == {}


def test_a_job_waiting_behind_replicas_names_their_deployment_and_what_frees_them():
    job = QueuedJob(1, 5, "cpu", devices=2)
    holder = RunningJob(17, 0, "cpu", ("cpu:0",))
    replicas = {"cpu:1": "replica 0 (v2) of deployment topics"}
    every = {"cpu": ["cpu:0", "cpu:1"]}
    plan = plan_starts([job], {"cpu": []}, every, Limits(replicas=replicas), running=[holder])
    assert plan.blocked == {
        1: "waiting for 2 cpu device(s) (0 free); 1 held by job 17, preemptible; cpu:1 held by replica 0 "
        "(v2) of deployment topics (`gpuforge undeploy topics` frees it)"
    }


def test_the_waiting_reason_names_who_holds_the_devices():
    job = QueuedJob(1, 5, "cuda", devices=2)
    holder = RunningJob(17, 0, "cuda", ("cuda:0",), project=3, preemptible=False)
    two_gpus = {"cuda": ["cuda:0", "cuda:1"]}
    plan = plan_starts([job], {"cuda": ["cuda:1"]}, two_gpus, Limits(names={3: "vision"}), running=[holder])
    assert plan.blocked == {
        1: "waiting for 2 cuda device(s) (1 free); 1 held by job 17 of project vision, not preemptible"
    }
    busy = [
        running(21, ["cuda:0"], priority=5),
        running(22, ["cuda:1"], priority=9),
        running(23, ["cuda:2"], stopping=True),
        running(24, ["cuda:3"], priority=9),
    ]
    reason = plan_starts([QueuedJob(1, 5, "cuda", devices=4)], {"cuda": []}, GPUS, running=busy).blocked[1]
    assert reason == (
        "waiting for 4 cuda device(s) (0 free); 1 held by job 21, priority 5; 1 held by job 22, priority 9; "
        "1 held by job 23, stopping; and 1 more"
    )


def test_a_later_blocked_job_neither_preempts_for_devices_held_back_for_an_earlier_one_nor_twice():
    onprem = QueuedJob(1, 5, "cuda", devices=2, placement=ONPREM)
    anywhere = QueuedJob(2, 5, "cuda", devices=4)
    busy = [running(101, ["cuda:0", "cuda:1"]), running(102, ["cuda:2"]), running(103, ["cuda:3"])]
    plan = plan_starts([onprem, anywhere], {"cuda": []}, GPUS, running=busy, labels=LABELS)
    # 2 cannot have all four before 1 has run: stopping 102 and 103 now would lose their work for nothing
    assert plan.preempt == {101: 1} and set(plan.blocked) == {1, 2}
    # a gang across both sites preempted for 1 frees its cloud device for 2 too: it is not picked twice
    cloud = QueuedJob(2, 5, "cuda", devices=2, placement=CLOUD)
    busy = [running(101, ["cuda:3"]), running(102, ["cuda:1", "cuda:2"])]
    plan = plan_starts([onprem, cloud], {"cuda": ["cuda:0"]}, GPUS, running=busy, labels=LABELS)
    assert plan.preempt == {102: 1, 101: 2}


# --- backfill ---------------------------------------------------------------------------------------------


def test_a_short_job_backfills_only_when_it_ends_before_the_blocked_job_could_start():
    big = QueuedJob(1, 0, "cuda", devices=4)
    busy = [running(101, ["cuda:0", "cuda:1", "cuda:2"], ends_in_s=600.0)]  # big can start in 10 minutes
    free = {"cuda": ["cuda:3"]}

    def plan_with(planned_s):
        return plan_starts([big, QueuedJob(2, 0, "cuda", planned_s=planned_s)], free, GPUS, running=busy)

    plan = plan_with(300.0)
    assert plan.starts == [(2, ["cuda:3"])] and plan.backfilled == [2] and list(plan.blocked) == [1]
    assert plan_with(600.0).backfilled == [2]  # ends exactly when big could start: it delays nothing
    assert plan_with(601.0).starts == []  # would delay it
    assert plan_with(None).starts == []  # no planned time: it cannot promise


def test_no_backfill_when_an_end_is_unknown_or_the_blocked_job_preempts():
    big = QueuedJob(1, 5, "cuda", devices=4)
    short = QueuedJob(2, 0, "cuda", planned_s=1.0)
    unknown = [running(101, ["cuda:0", "cuda:1", "cuda:2"], priority=9)]  # no end known
    plan = plan_starts([big, short], {"cuda": ["cuda:3"]}, GPUS, running=unknown)
    assert plan.starts == [] and plan.backfilled == []
    preemptible = [running(101, ["cuda:0", "cuda:1", "cuda:2"], ends_in_s=3600.0)]
    plan = plan_starts([big, short], {"cuda": ["cuda:3"]}, GPUS, running=preemptible)
    assert plan.preempt == {101: 1} and plan.starts == []  # its devices come now: nobody slips in


def test_backfill_counts_the_earliest_moment_enough_devices_free():
    big = QueuedJob(1, 0, "cuda", devices=3)
    busy = [
        running(101, ["cuda:0"], ends_in_s=100.0),
        running(102, ["cuda:1"], ends_in_s=500.0),
        running(103, ["cuda:2"], ends_in_s=None),
    ]
    # 1 free + 101 at 100 s + 102 at 500 s = 3: big could start at 500 s, whatever 103 does
    jobs = [big, QueuedJob(2, 0, "cuda", planned_s=450.0), QueuedJob(3, 0, "cuda", planned_s=50.0)]
    plan = plan_starts(jobs, {"cuda": ["cuda:3"]}, GPUS, running=busy)
    assert plan.starts == [(2, ["cuda:3"])] and plan.backfilled == [2]


# --- placement --------------------------------------------------------------------------------------------


def test_placement_uses_only_matching_devices_and_holds_back_only_those():
    jobs = [QueuedJob(1, 0, "cuda", placement=ONPREM), QueuedJob(2, 0, "cuda", placement=CLOUD)]
    free = {"cuda": ["cuda:3", "cuda:2", "cuda:1"]}
    plan = plan_starts(jobs, free, GPUS, labels=LABELS)
    assert plan.starts == [(1, ["cuda:1"]), (2, ["cuda:3"])]
    # a blocked on-premises gang holds back the on-premises devices only; the cloud goes on
    gang = QueuedJob(3, 9, "cuda", devices=2, placement=ONPREM)
    plan = plan_starts([gang, *jobs], free, GPUS, labels=LABELS)
    assert plan.starts == [(2, ["cuda:3"])] and list(plan.blocked) == [3]
    assert plan.blocked[3] == "waiting for 2 cuda site=onprem device(s) (1 free)"
    # a job with no placement may use any device that is not held back
    plan = plan_starts([gang, QueuedJob(4, 0, "cuda")], free, GPUS, labels=LABELS)
    assert plan.starts == [(4, ["cuda:3"])]


def test_placement_no_device_could_ever_match_is_impossible_with_the_counts():
    jobs = [
        QueuedJob(1, 0, "cuda", devices=3, placement=ONPREM),
        QueuedJob(2, 0, "cuda", placement=(("gpu", "h100"),)),
    ]
    plan = plan_starts(jobs, GPUS, GPUS, labels=LABELS)
    assert plan.impossible == {
        1: "asks for 3 cuda device(s) labelled site=onprem; this server has 2 such (of 4 cuda)",
        2: "asks for 1 cuda device(s) labelled gpu=h100; this server has 0 such (of 4 cuda)",
    }
    assert plan.starts == []
