"""The dynamic batcher on its own: batch forming, waiting, backpressure, timeouts, failures, draining."""

import asyncio
import threading
import time

import pytest

from gpuforge.serve.batcher import Batcher, QueueFull


class Model:
    """Records the batches it ran; `gate` holds it inside a batch until set."""

    def __init__(self, seconds=0.0):
        self.batches, self.seconds, self.gate = [], seconds, threading.Event()
        self.gate.set()

    def __call__(self, items):
        self.gate.wait()
        time.sleep(self.seconds)
        self.batches.append(list(items))
        return [ValueError(f"bad {i}") if i == "bad" else i * 2 for i in items]


def run(coro):
    return asyncio.run(coro)


def test_requests_arriving_together_share_one_batch_up_to_its_limit():
    async def main():
        model = Model()
        batcher = Batcher(model, max_batch=4, max_wait_ms=50)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
        await batcher.stop()
        return model, results

    model, results = run(main())
    assert results == [i * 2 for i in range(10)]
    assert [len(b) for b in model.batches] == [4, 4, 2] and sum(model.batches, []) == list(range(10))


def test_a_request_that_finds_the_model_idle_runs_at_once_and_a_lone_client_never_waits():
    async def main():
        batcher = Batcher(Model(), max_batch=32, max_wait_ms=200)  # a wait no lone request may pay
        await batcher.start()
        waits = []
        for i in range(5):  # one client: each request sent when the last is answered
            start = time.perf_counter()
            await batcher.submit(i)
            waits.append(time.perf_counter() - start)
        await batcher.stop()
        return waits

    assert max(run(main())) < 0.1


def test_after_a_batch_of_several_the_next_waits_for_as_many_at_most_max_wait():
    async def main():
        model = Model()
        batcher = Batcher(model, max_batch=32, max_wait_ms=150)
        await batcher.start()
        await asyncio.gather(*(batcher.submit(i) for i in range(4)))  # 4 callers, answered together
        start = time.perf_counter()
        first = asyncio.ensure_future(batcher.submit(10))  # their next requests come in one by one
        for i in range(11, 14):
            await asyncio.sleep(0.01)
            batcher_task = asyncio.ensure_future(batcher.submit(i))
        await asyncio.gather(first, batcher_task)
        together = time.perf_counter() - start
        late = time.perf_counter()
        await batcher.submit(20)  # 3 callers of the 4 never came back: the wait ends at max_wait
        waited = time.perf_counter() - late
        late = time.perf_counter()
        await batcher.submit(21)  # the batch before held 1: this one runs at once
        alone = time.perf_counter() - late
        await batcher.stop()
        return model.batches, together, waited, alone

    batches, together, waited, alone = run(main())
    assert batches[:2] == [[0, 1, 2, 3], [10, 11, 12, 13]]  # the second batch waited for all 4
    assert together < 0.14  # and no longer than they took to come
    assert batches[2:] == [[20], [21]] and 0.14 <= waited < 0.5 and alone < 0.1


def test_while_the_model_works_the_next_batch_fills_without_waiting():
    async def main():
        model = Model(seconds=0.05)
        batcher = Batcher(model, max_batch=8, max_wait_ms=1000)  # a long wait that full batches never pay
        await batcher.start()
        start = time.perf_counter()
        await asyncio.gather(*(batcher.submit(i) for i in range(16)))
        elapsed = time.perf_counter() - start
        await batcher.stop()
        return model, elapsed

    model, elapsed = run(main())
    assert [len(b) for b in model.batches] == [8, 8] and elapsed < 0.9


def test_past_max_queue_the_caller_hears_queue_full_with_a_retry_time():
    async def main():
        model = Model()
        model.gate.clear()  # the model holds its first batch: the queue fills behind it
        batcher = Batcher(model, max_batch=2, max_wait_ms=0, max_queue=3)
        await batcher.start()
        first = [asyncio.ensure_future(batcher.submit(i)) for i in range(2)]
        await asyncio.sleep(0.05)  # taken into the model
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(2, 5)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await batcher.submit(99)
        model.gate.set()
        done = await asyncio.gather(*first, *queued)
        await batcher.stop()
        return refused.value, done

    refused, done = run(main())
    assert refused.retry_after_s >= 1 and done == [0, 2, 4, 6, 8]


def test_a_caller_that_gives_up_costs_no_model_time():
    async def main():
        model = Model()
        model.gate.clear()
        batcher = Batcher(model, max_batch=1, max_wait_ms=0)
        await batcher.start()
        busy = asyncio.ensure_future(batcher.submit("first"))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await batcher.submit("given up", timeout_s=0.05)
        model.gate.set()
        await busy
        await batcher.submit("after")
        await batcher.stop()
        return model.batches

    assert run(main()) == [["first"], ["after"]]


def test_an_item_that_fails_alone_leaves_the_others_of_its_batch_their_results():
    async def main():
        batcher = Batcher(Model(), max_batch=8, max_wait_ms=20)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(i) for i in (1, "bad", 3)), return_exceptions=True)
        await batcher.stop()
        return results

    ok1, bad, ok3 = run(main())
    assert (ok1, ok3) == (2, 6) and isinstance(bad, ValueError) and str(bad) == "bad bad"


def test_a_batch_that_raises_reaches_each_caller_and_the_batcher_goes_on():
    calls = []

    def flaky(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("model broke")
        return list(items)

    async def main():
        batcher = Batcher(flaky, max_batch=4, max_wait_ms=20)
        await batcher.start()
        first = await asyncio.gather(*(batcher.submit(i) for i in range(2)), return_exceptions=True)
        second = await batcher.submit(7)
        await batcher.stop()
        return first, second

    first, second = run(main())
    assert all(isinstance(e, RuntimeError) for e in first) and second == 7


def test_stop_answers_what_is_queued_then_refuses():
    async def main():
        batcher = Batcher(Model(seconds=0.02), max_batch=2, max_wait_ms=0)
        await batcher.start()
        pending = [asyncio.ensure_future(batcher.submit(i)) for i in range(6)]
        await asyncio.sleep(0)
        await batcher.stop()
        with pytest.raises(QueueFull):
            await batcher.submit(1)
        return await asyncio.gather(*pending)

    assert run(main()) == [0, 2, 4, 6, 8, 10]
