"""Fractions of a device: best-fit packing in the queue's pass (no fragmenting what whole jobs need, no
fraction over two devices), preemption of a shared device by all its fractions, quotas counted by the
fraction, and what isolates a fraction (cores pinned, a GPU memory cap, MPS) in the words its job shows."""

from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.queue import Limits, QueuedJob, RunningJob, plan_starts
from gpuforge.scheduler.sharing import best_fit, cores_in, cpu_share, gpu_share, isolation_for

GPUS = {"cuda": ["cuda:0", "cuda:1", "cuda:2"]}


def half(job_id, share=0.5, priority=0, **kw) -> QueuedJob:
    return QueuedJob(job_id, priority, "cuda", share=share, **kw)


def test_best_fit_fills_the_fullest_shared_device_then_opens_the_last_free_one():
    assert best_fit(["cuda:0", "cuda:1", "cuda:2"], {"cuda:1": 0.25, "cuda:2": 0.5}, 0.5) == "cuda:2"
    assert best_fit(["cuda:0", "cuda:1", "cuda:2"], {"cuda:1": 0.75}, 0.25) == "cuda:1"
    # no shared device has room: the last whole one, so the first ones stay whole
    assert best_fit(["cuda:0", "cuda:1", "cuda:2"], {"cuda:2": 0.75}, 0.5) == "cuda:1"
    assert best_fit(["cuda:0"], {"cuda:0": 0.75}, 0.5) is None


def test_two_halves_share_one_device_and_a_whole_job_keeps_the_first_one():
    jobs = [half(1), half(2), QueuedJob(3, 0, "cuda", devices=2)]
    plan = plan_starts(jobs, {"cuda": list(GPUS["cuda"])}, GPUS)
    assert plan.starts == [(1, ["cuda:2"]), (2, ["cuda:2"]), (3, ["cuda:0", "cuda:1"])]


def test_a_shared_device_is_not_free_for_a_whole_job_and_a_fraction_fits_beside_others():
    busy = [RunningJob(11, 0, "cuda", ("cuda:2",), share=0.5)]
    free = {"cuda": ["cuda:0", "cuda:1"]}
    plan = plan_starts([half(2, 0.25), half(3, 0.5)], free, GPUS, running=busy, shared={"cuda:2": 0.5})
    assert plan.starts == [(2, ["cuda:2"]), (3, ["cuda:1"])]  # beside it, then the last whole free one
    # a 3-device job waits for cuda:2 and holds all three back: no fraction may delay it further
    plan = plan_starts(
        [QueuedJob(1, 0, "cuda", devices=3), half(2, 0.25)], free, GPUS, running=busy, shared={"cuda:2": 0.5}
    )
    assert "0.5 of cuda:2 held by job 11" in plan.blocked[1]
    assert plan.starts == [] and plan.blocked[2] == (
        "waiting for 0.25 of a cuda device: none has room (cuda:0 held back for an earlier job; cuda:1 held "
        "back for an earlier job; cuda:2 held back for an earlier job)"
    )


def test_a_fraction_that_finds_no_room_makes_later_fractions_wait_behind_it():
    plan = plan_starts(
        [half(1, 0.75), half(2, 0.25)], {"cuda": []}, {"cuda": ["cuda:0"]}, shared={"cuda:0": 0.5}
    )
    assert plan.starts == []
    assert plan.blocked[2].endswith("behind an earlier fraction that waits for room")


def test_preempting_for_a_whole_job_takes_every_fraction_on_a_device():
    busy = [
        RunningJob(11, 0, "cuda", ("cuda:0",), share=0.5),
        RunningJob(12, 0, "cuda", ("cuda:0",), share=0.25),
        RunningJob(13, 0, "cuda", ("cuda:1",)),
        RunningJob(14, 9, "cuda", ("cuda:2",), share=0.5),  # above the urgent job: its device stays
    ]
    urgent = QueuedJob(1, 5, "cuda", devices=2)
    plan = plan_starts([urgent], {"cuda": []}, GPUS, running=busy, shared={"cuda:0": 0.75, "cuda:2": 0.5})
    assert plan.preempt == {13: 1, 12: 1, 11: 1}
    # one device needed: the whole job alone goes (one job lost, not two)
    plan = plan_starts([QueuedJob(1, 5, "cuda")], {"cuda": []}, GPUS, running=busy, shared={"cuda:0": 0.75})
    assert plan.preempt == {13: 1}


def test_quotas_count_a_fraction_as_that_much_of_a_device():
    limits = Limits(project_devices={7: 1.5}, max_devices={7: 2}, names={7: "vision"})
    plan = plan_starts(
        [half(1, project=7), half(2, project=7), QueuedJob(3, 0, "cuda", project=7)],
        {"cuda": list(GPUS["cuda"])},
        GPUS,
        limits,
    )
    assert [job for job, _ in plan.starts] == [1]
    assert plan.held[2] == "waiting for project vision's max_devices 2: it holds 2, this job asks for 0.5"
    assert plan.held[3] == "waiting for project vision's max_devices 2: it holds 2, this job asks for 1"


def test_a_share_of_a_cpu_slot_is_pinned_to_cores_no_other_share_holds():
    first = cpu_share(0.5, [0, 1, 2, 3], taken=set())
    assert first.environment["GPUFORGE_CPU_CORES"] == "0,1" and first.environment["OMP_NUM_THREADS"] == "2"
    assert first.said == "cores 0,1 (2 of 4, pinned)"
    second = cpu_share(0.5, [0, 1, 2, 3], taken=cores_in(first.said))
    assert second.environment["GPUFORGE_CPU_CORES"] == "2,3"
    # a slot of one core: a quarter still gets one, and says it shares it
    assert cpu_share(0.25, [5], taken={5}).said == "cores 5 (1 of 1, pinned, some shared with another job)"


def test_a_share_of_a_gpu_is_capped_in_memory_and_says_how_its_compute_is_shared():
    gpu = DeviceInfo("cuda:1", "cuda", "NVIDIA H100", memory_bytes=80 * 2**30)
    sliced = isolation_for(gpu, 0.5, set(), mps=False)
    assert sliced.environment["CUDA_VISIBLE_DEVICES"] == "1"
    assert sliced.environment["GPUFORGE_CUDA_MEMORY_FRACTION"] == "0.5"
    assert sliced.environment["CUDA_DEVICE_MEMORY_LIMIT"] == "40960m"
    assert sliced.said.startswith("memory cap 40 GiB (PyTorch allocator;")
    assert sliced.said.endswith("time-sliced")
    shared = gpu_share(0.25, "0", 80 * 2**30, mps=True)
    assert shared.environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert shared.environment["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert shared.said.endswith("MPS 25 %")
    assert gpu_share(0.5, "0", None, mps=False).said == "time-sliced, no cap"
