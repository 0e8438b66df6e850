"""The generation scheduler alone, without a model: who joins the running batch and when, the waiting
queue's limits and Retry-After, cancelling, and stopping with and without draining."""

import asyncio
import threading
import time

import pytest

from gpuforge.serve.batcher import QueueFull
from gpuforge.serve.generation.request import EngineStopped, PromptTooLong, SamplingParams, SequenceState
from gpuforge.serve.generation.scheduler import GenerationScheduler


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _seq(loop, prompt=(1, 2, 3)) -> SequenceState:
    params = SamplingParams(max_tokens=4, temperature=0)
    return SequenceState(list(prompt), len(prompt), params, 4, loop, asyncio.Queue(), None)


def _in_thread(call):
    """Run `call` on a thread of its own (as the model thread runs next_batch); its result or error."""
    result = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as err:  # handed back to the test
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_admits_in_order_up_to_max_batch_beside_the_running_ones_and_skips_cancelled(loop):
    scheduler = GenerationScheduler(max_batch=3, max_queue=8)
    a, b, c, d, e = (_seq(loop) for _ in range(5))
    for seq in (a, b, c, d, e):
        scheduler.enqueue(seq)
    b.cancelled = True  # dropped unread (Generation.__del__): still queued, never admitted
    assert scheduler.next_batch(running=1) == [a, c]
    assert scheduler.queued == 2
    assert scheduler.next_batch(running=3) == []  # a full batch admits nobody, and does not wait
    assert scheduler.next_batch(running=0) == [d, e] and scheduler.queued == 0


def test_a_cancelled_waiting_request_leaves_the_queue_at_once(loop):
    scheduler = GenerationScheduler(max_batch=1, max_queue=2)
    first, second = _seq(loop), _seq(loop)
    scheduler.enqueue(first)
    scheduler.enqueue(second)
    scheduler.cancel(first)
    assert first.cancelled and scheduler.queued == 1
    assert scheduler.next_batch(running=0) == [second]


def test_a_burst_still_arriving_is_waited_for_a_moment_and_admitted_together(loop):
    scheduler = GenerationScheduler(max_batch=8, max_queue=8)
    burst = [_seq(loop) for _ in range(3)]
    scheduler.enqueue(burst[0])
    thread, result = _in_thread(lambda: scheduler.next_batch(running=1, linger_s=0.6))
    for seq in burst[1:]:  # each within half the linger of the one before
        time.sleep(0.05)
        scheduler.enqueue(seq)
    thread.join(5)
    assert result == {"value": burst}


def test_the_wait_for_a_burst_is_bounded_and_skipped_when_nobody_came_just_now_or_the_batch_is_full(loop):
    scheduler = GenerationScheduler(max_batch=64, max_queue=64)
    scheduler.enqueue(_seq(loop))
    began = time.monotonic()
    thread, result = _in_thread(lambda: scheduler.next_batch(running=0, linger_s=0.3))
    while thread.is_alive() and time.monotonic() - began < 5:  # arrivals that never stop
        scheduler.enqueue(_seq(loop))
        time.sleep(0.01)
    assert time.monotonic() - began < 1.0 and len(result["value"]) > 1

    quiet = GenerationScheduler(max_batch=4, max_queue=4)
    quiet.enqueue(_seq(loop))
    time.sleep(0.2)  # the last arrival is older than half the linger: no burst
    began = time.monotonic()
    assert len(quiet.next_batch(running=0, linger_s=0.3)) == 1 and time.monotonic() - began < 0.1
    full = GenerationScheduler(max_batch=2, max_queue=4)
    full.enqueue(_seq(loop))
    began = time.monotonic()
    assert len(full.next_batch(running=1, linger_s=5.0)) == 1 and time.monotonic() - began < 0.5


def test_the_model_thread_waits_for_work_and_ends_once_stopped_with_nothing_left(loop):
    scheduler = GenerationScheduler(max_batch=4, max_queue=4)
    thread, result = _in_thread(lambda: scheduler.next_batch(running=0))
    thread.join(0.1)
    assert thread.is_alive(), result  # nothing to do: it waits
    seq = _seq(loop)
    scheduler.enqueue(seq)
    thread.join(5)
    assert not thread.is_alive() and result == {"value": [seq]}

    thread, result = _in_thread(lambda: scheduler.next_batch(running=0))
    thread.join(0.1)
    assert thread.is_alive(), result
    scheduler.stop(drain=True, running=[])
    thread.join(5)
    assert not thread.is_alive() and result == {"value": None}


def test_a_draining_stop_still_admits_the_waiting_and_lets_the_running_batch_go_on(loop):
    scheduler = GenerationScheduler(max_batch=2, max_queue=4)
    waiting = _seq(loop)
    scheduler.enqueue(waiting)
    scheduler.stop(drain=True, running=[])
    assert scheduler.next_batch(running=1) == [waiting]
    assert scheduler.next_batch(running=2) == []  # two still run: the model thread goes on
    assert scheduler.next_batch(running=0) is None
    with pytest.raises(QueueFull) as refused:  # stopping: nothing new is queued
        scheduler.check_room(running=0)
    assert refused.value.retry_after_s == 1.0
    scheduler.start()
    scheduler.check_room(running=0)


def test_a_stop_without_draining_ends_the_waiting_and_the_running_with_engine_stopped():
    async def main():
        loop = asyncio.get_running_loop()
        scheduler = GenerationScheduler(max_batch=2, max_queue=4)
        waiting, running = _seq(loop), _seq(loop)
        scheduler.enqueue(waiting)
        scheduler.stop(drain=False, running=[running])
        heard = [await asyncio.wait_for(seq.queue.get(), 5) for seq in (waiting, running)]
        return scheduler, waiting, running, heard

    scheduler, waiting, running, heard = asyncio.run(main())
    assert all(isinstance(item, EngineStopped) for item in heard), heard
    assert waiting.cancelled and running.cancelled and scheduler.queued == 0
    assert scheduler.next_batch(running=0) is None


def test_past_max_queue_retry_after_counts_the_waves_ahead_at_the_seconds_a_request_takes(loop):
    scheduler = GenerationScheduler(max_batch=2, max_queue=2)
    scheduler.check_room(running=4)
    for _ in range(2):
        scheduler.enqueue(_seq(loop))
    with pytest.raises(QueueFull) as refused:
        scheduler.check_room(running=0)
    assert refused.value.retry_after_s == 1.0  # one wave ahead at the first guess of 1 s: never under 1 s
    scheduler.finished(11.0)  # 0.8 * 1 + 0.2 * 11
    assert scheduler.seconds_per_request == pytest.approx(3.0)
    with pytest.raises(QueueFull) as refused:
        scheduler.check_room(running=4)
    assert refused.value.retry_after_s == pytest.approx(3 * 3.0)  # (2 waiting + 4 running) / 2 a wave


@pytest.mark.parametrize(
    ("ids", "error", "says"),
    [
        ([], ValueError, "the prompt is empty"),
        ([1, 300], ValueError, r"prompt token ids must be in \[0, 257\)"),
        ([-1], ValueError, r"prompt token ids must be in \[0, 257\)"),
        ([1] * 16, PromptTooLong, "the prompt is 16 tokens; the model's context is 16 tokens"),
    ],
)
def test_a_prompt_the_model_cannot_take_is_refused_with_the_reason(ids, error, says):
    scheduler = GenerationScheduler(max_batch=1, max_queue=1)
    with pytest.raises(error, match=says):
        scheduler.check_prompt(ids, context=16, vocab=257)
    scheduler.check_prompt([1] * 15, context=16, vocab=257)  # one token of room is enough


def test_max_batch_and_max_queue_must_be_positive():
    for limits in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="max_batch and max_queue must be >= 1"):
            GenerationScheduler(*limits)
