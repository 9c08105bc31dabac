"""Background tasks beside the training loop (the generation loops, scoring, the watchdog):
the first one that fails ends the training loop's wait for a batch (``until_failure``) with
its error."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self) -> None:
        self.failure: BaseException | None = None
        # the task in until_failure, cancelled by a failure
        self._racing: asyncio.Task | None = None

    def watch(self, task: asyncio.Task, members: set | None = None) -> asyncio.Task:
        """Remember the first exception of ``task`` and wake the training loop; ``members``:
        a set that holds the task while it runs."""
        if members is not None:
            members.add(task)

        def done(t: asyncio.Task) -> None:
            if members is not None:
                members.discard(t)
            if not t.cancelled() and t.exception() is not None and self.failure is None:
                self.failure = t.exception()
                if self._racing is not None:  # interrupt the step waiting in until_failure
                    self._racing.cancel()

        task.add_done_callback(done)
        return task

    async def until_failure(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` unless a watched task fails first; then raise that.

        The failure cancels the task awaiting here (as a task racing ``coro`` would, but
        without two tasks and a wait on the loop every step). The training loop races only
        its wait for a batch: a step cancelled while its trainer call runs would be finished
        by the trainer unseen, and the checkpoint taken before the job fails would then
        label the trainer's state a step behind (a torch_dist generator's loss did)."""
        if self.failure is not None:
            coro.close()
            raise self.failure
        self._racing = asyncio.current_task()
        try:
            return await coro
        except asyncio.CancelledError:
            if self.failure is None:  # a cancel from outside (the run is being torn down)
                raise
            self._racing.uncancel()
            raise self.failure from None
        finally:
            self._racing = None

    def checked(self, value: Any) -> Any:
        """``value``, unless a watched task failed meanwhile (while a step ran, which
        ``until_failure`` leaves to finish): then that failure, raised here."""
        if self.failure is not None:
            raise self.failure
        return value

    @staticmethod
    async def cancel(tasks: list[asyncio.Task]) -> None:
        """Cancel ``tasks`` and wait until they have ended."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
