"""Between the engine thread and the server's event loop, in batches.

- Waker: the engine thread calls notify(run) after each update of one of its requests; wake-ups
  are coalesced into one call_soon_threadsafe per burst (one step updates every running request)
  instead of one self-pipe write per request.
- Submitter: requests that arrive together are submitted together (`submit_many`: under ONE
  acquisition of the engine lock, or in one command to a core process, between two steps)
  instead of each waiting for the lock on its own: with 16 clients arriving at once, they are
  admitted in the same step as LLM.generate would admit them.
  When the engine is idle the first arrival waits IDLE_WINDOW_S for companions, so a burst does
  not start with a step that prefills one request alone (at most that much added TTFT)."""

from __future__ import annotations

import asyncio
import threading

IDLE_WINDOW_S = 0.01


class Waker:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: set = set()
        self._scheduled = False

    def notify(self, run) -> None:  # engine thread
        with self._lock:
            self._pending.add(run)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._fire)
        except RuntimeError:  # the loop is closed (server stopping)
            pass

    def _fire(self) -> None:  # event loop
        with self._lock:
            runs, self._pending, self._scheduled = self._pending, set(), False
        for run in runs:
            run.event.set()


class Submitter:
    def __init__(self, thread, loop: asyncio.AbstractEventLoop):
        self.thread, self.loop = thread, loop
        self._queue: list = []
        self._draining = False

    async def submit_batched(self, prompt, params, **kw):
        """EngineThread.submit(prompt, params, **kw) from the event loop, together with the
        requests that arrive with it (one engine-lock acquisition); raises what it raises."""
        fut = self.loop.create_future()
        self._queue.append((prompt, params, kw, fut))
        if not self._draining:
            self._draining = True
            self.loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                idle = not self.thread.engine.has_unfinished_requests()
                await asyncio.sleep(IDLE_WINDOW_S if idle else 0)  # let a burst join the batch
                batch, self._queue = self._queue, []
                results = await asyncio.to_thread(self._submit_all, batch)
                for (_, _, _, fut), res in zip(batch, results):
                    if fut.done():
                        continue
                    if isinstance(res, BaseException):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
        finally:
            self._draining = False

    def _submit_all(self, batch) -> list:
        # one lock acquisition (EngineThread) or one round trip to the core (EngineClient) for
        # the whole batch: one step admits them all
        return self.thread.submit_many([(prompt, params, kw) for prompt, params, kw, _ in batch])
