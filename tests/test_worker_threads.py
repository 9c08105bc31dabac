"""``WorkerThreads``: an executor's own thread (and its concurrent endpoints' pool), in
place of ThreadPoolExecutors. On one thread calls run one at a time in order, results and exceptions reach the caller, a shutdown that
cancels leaves no caller waiting forever, and the loop's futures of ``on_thread`` follow."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest

from loomrl.runtime.threads import WorkerThreads, on_thread


def test_calls_run_on_one_thread_in_order_and_deliver_results_and_errors():
    worker = WorkerThreads("loomrl-test")
    seen: list[tuple[int, str]] = []
    futures = [
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i * i)
        for i in range(50)
    ]
    assert [f.result(timeout=5) for f in futures] == [i * i for i in range(50)]
    assert [i for i, _ in seen] == list(range(50)) and {name for _, name in seen} == {"loomrl-test"}
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result(timeout=5)
    worker.shutdown(wait=True)
    assert not worker._threads[0].is_alive()
    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.submit(lambda: None)


def test_a_pool_runs_calls_side_by_side_up_to_its_size_and_starts_no_more_threads():
    pool = WorkerThreads("loomrl-test-c", max_workers=4)
    assert pool._threads == []  # (started when a call finds none idle)
    barrier = threading.Barrier(4, timeout=5)  # breaks unless 4 calls run at once
    assert sorted(f.result(timeout=10) for f in [pool.submit(barrier.wait) for _ in range(4)]) == [
        0,
        1,
        2,
        3,
    ]
    for _ in range(3):
        assert sorted(
            f.result(timeout=5) for f in [pool.submit(lambda i=i: i) for i in range(20)]
        ) == list(range(20))
    assert len(pool._threads) == 4 and {t.name for t in pool._threads} == {
        f"loomrl-test-c_{i}" for i in range(4)
    }
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)


def test_a_cancelling_shutdown_cancels_what_is_queued_and_lets_the_running_call_finish():
    worker = WorkerThreads("loomrl-test")
    started, release = threading.Event(), threading.Event()
    running = worker.submit(lambda: (started.set(), release.wait(5), "done")[2])
    started.wait(5)
    queued = [worker.submit(lambda: "never") for _ in range(3)]
    threading.Timer(0.1, release.set).start()
    worker.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=5) == "done"
    for f in queued:
        with pytest.raises(CancelledError):
            f.result(timeout=5)


def test_a_shutdown_without_cancel_runs_what_is_queued():
    worker = WorkerThreads("loomrl-test")
    futures = [worker.submit(lambda i=i: i) for i in range(5)]
    worker.shutdown(wait=False)
    assert [f.result(timeout=5) for f in futures] == list(range(5))


def test_on_thread_futures_resolve_on_the_loop_and_a_dropped_call_cancels_its_future():
    async def main() -> None:
        worker = WorkerThreads("loomrl-test")
        loop = asyncio.get_running_loop()
        done: list[str] = []
        assert (
            await on_thread(loop, worker, lambda: done.append("on_done"), lambda x: x + 1, 41) == 42
        )
        assert done == ["on_done"]
        with pytest.raises(KeyError):
            await on_thread(loop, worker, None, {}.__getitem__, "missing")
        # A call cancelled before it starts does not run (skip_cancelled).
        gate = threading.Event()
        blocker = on_thread(loop, worker, None, gate.wait, 5)
        ran: list[int] = []
        skipped = on_thread(loop, worker, None, ran.append, 1, skip_cancelled=True)
        skipped.cancel()
        gate.set()
        await blocker
        # Dropped unrun by a cancelling shutdown: the loop's future is cancelled, not left pending.
        gate.clear()
        started = threading.Event()
        blocker = on_thread(loop, worker, None, lambda: (started.set(), gate.wait(5)))
        dropped = on_thread(loop, worker, None, ran.append, 2)
        # the thread holds the blocker, not ``dropped``
        assert await asyncio.to_thread(started.wait, 5)
        # (``dropped`` is still queued: the thread waits on the gate)
        worker.shutdown(wait=False, cancel_futures=True)
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(dropped, 5)
        worker._threads[0].join(5)
        assert ran == [] and not worker._threads[0].is_alive()

    asyncio.run(main())
