"""The dynamic batcher: requests that arrive within `max_wait_ms` of each other run as one batch of at
most `max_batch`, in one model thread, while the event loop goes on accepting requests.

    batcher = Batcher(run_batch, max_batch=32, max_wait_ms=5, max_queue=256)
    await batcher.start()
    result = await batcher.submit(item, timeout_s=30)    # QueueFull past max_queue: answer 429
    await batcher.stop()                                  # drains what is queued first

`run_batch(items)` runs in the model thread and returns one result per item, an Exception standing for
an item that failed alone (the others in its batch still get their results). An item whose caller gave
up (timeout, disconnected client) before its batch formed is dropped, so it costs no model time.
Batches are taken as soon as the model thread is free: while it works on one batch the next one fills,
so under load batches are full without waiting. A request that finds the model idle runs at once, alone:
waiting for a batch pays only when one is coming. It is coming when the model has just answered a batch of
several (their callers, answered, send their next requests within a few milliseconds): then the batcher
waits, at most `max_wait_ms` from the first arrival, for as many as that batch held. A lone client, or
requests spaced wider than `max_wait_ms`, never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The bounded queue is full: the caller should retry after `retry_after_s`."""

    def __init__(self, retry_after_s: float):
        super().__init__(f"queue full; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass
class _Pending:
    item: Any
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """What one batch did, for the worker's metrics."""

    size: int
    queue_seconds: list[float]
    run_seconds: float


class Batcher:
    def __init__(
        self,
        run_batch: Callable[[Sequence[Any]], list[Any]],
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 256,
        on_batch: Callable[[BatchStats], None] | None = None,
    ):
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_ms >= 0")
        self.run_batch, self.max_batch, self.max_wait_s = run_batch, max_batch, max_wait_ms / 1000
        self.max_queue, self.on_batch = max_queue, on_batch
        self._queue: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._model = ThreadPoolExecutor(1, thread_name_prefix="gpuforge-model")  # one batch at a time
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._seconds_per_item = 0.01  # a running estimate, for Retry-After
        self._last_size, self._last_end = 0, 0.0  # the last batch: how many it held, when it ended

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="gpuforge-batcher")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        self._stopping = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        self._model.shutdown(wait=True)

    def room_for(self, n: int) -> None:
        """QueueFull unless `n` more items fit now: a request of several inputs is taken whole or not at all
        (nothing runs for a request that is refused). Nothing is awaited between this and their submits."""
        if self._stopping:
            raise QueueFull(1.0)
        if len(self._queue) + n > self.max_queue:
            raise QueueFull(max(1.0, len(self._queue) * self._seconds_per_item))

    async def submit(self, item: Any, timeout_s: float | None = None) -> Any:
        self.room_for(1)
        pending = _Pending(item, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._arrived.set()
        # Timed out or cancelled, the await cancels the future itself: the batch forming skips it.
        async with asyncio.timeout(timeout_s):
            return await pending.future

    async def _loop(self) -> None:
        while True:
            while not self._queue:
                if self._stopping:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            batch = await self._take()
            if batch:
                await self._run(batch)

    async def _take(self) -> list[_Pending]:
        """Up to max_batch live items: what is queued now, plus, when a batch is coming (see the module's
        docstring), what arrives within max_wait of the first."""
        first = self._queue[0].enqueued
        coming = self._last_size > 1 and first - self._last_end < self.max_wait_s
        wanted = min(self.max_batch, self._last_size) if coming else 1
        deadline = first + self.max_wait_s
        while len(self._queue) < wanted and not self._stopping:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        batch = []
        while self._queue and len(batch) < self.max_batch:
            pending = self._queue.popleft()
            if not pending.future.done():  # a caller that gave up costs nothing
                batch.append(pending)
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._model, self.run_batch, [p.item for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch gave {len(results)} results for {len(batch)} items")
        except Exception as err:  # the whole batch failed: each caller hears why
            results = [err] * len(batch)
        self._last_end = time.perf_counter()
        self._last_size = len(batch)
        seconds = self._last_end - started
        self._seconds_per_item = 0.8 * self._seconds_per_item + 0.2 * seconds / len(batch)
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():
                continue
            if isinstance(result, Exception):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        if self.on_batch is not None:
            self.on_batch(BatchStats(len(batch), [started - p.enqueued for p in batch], seconds))
