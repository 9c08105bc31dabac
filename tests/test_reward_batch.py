"""Batched reward calls: one worker pass per batch, each item still with its own timeout."""

from __future__ import annotations

import asyncio
import threading
import time

from loomrl.scoring.calls import RewardFailure, call_reward_batch


def _reward(prompt, completion, **row):
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "hang":
        time.sleep(row["hang_s"])
        return 1.0
    if completion == "nan":
        return float("nan")
    return float(len(completion))


def test_each_item_gets_its_outcome_and_a_hung_item_times_out_alone():
    items = [("p", c, {"hang_s": 3.0}) for c in ("ab", "raise", "hang", "abc", "nan", "a")]
    t0 = time.monotonic()
    results = asyncio.run(call_reward_batch(_reward, items, timeout_s=0.3))
    elapsed = time.monotonic() - t0
    values = [v for v, _ in results]
    assert values[0] == 2.0 and values[3] == 3.0 and values[5] == 1.0
    assert (
        isinstance(values[1], RewardFailure)
        and values[1].reason == "raised"
        and "bad completion" in str(values[1])
    )
    assert isinstance(values[2], RewardFailure) and values[2].reason == "timeout"
    assert isinstance(values[4], RewardFailure) and values[4].reason == "invalid"
    assert elapsed < 2.0  # the items after the hung one did not wait for it
    assert all(seconds >= 0 for _, seconds in results)


def test_a_batch_of_sync_calls_runs_in_one_contiguous_chunk_per_worker():
    from loomrl.scoring.calls import _REWARD_THREADS

    seen: list[tuple[int, int]] = []  # (item, thread)

    def reward(prompt, completion, **row):
        seen.append((int(completion), threading.get_ident()))
        return 1.0

    results = asyncio.run(
        call_reward_batch(reward, [("p", str(i), {}) for i in range(64)], timeout_s=5.0)
    )
    assert [v for v, _ in results] == [1.0] * 64
    threads = {t for _, t in seen}
    assert 1 <= len(threads) <= _REWARD_THREADS.size and threading.get_ident() not in threads
    for thread in threads:  # a worker runs its chunks' items in order (it may take two chunks)
        items = [i for i, t in seen if t == thread]
        assert items == sorted(items)
    # four chunks of 16: the loop waits for 4 runs, not 64 calls
    assert sorted(i for i, _ in seen) == list(range(64))


def test_async_rewards_are_scored_too():
    async def reward(prompt, completion, **row):
        await asyncio.sleep(0.01 if completion != "slow" else 2.0)
        return 0.5

    results = asyncio.run(
        call_reward_batch(reward, [("p", c, {}) for c in ("a", "slow", "b")], timeout_s=0.3)
    )
    assert results[0][0] == 0.5 and results[2][0] == 0.5
    assert isinstance(results[1][0], RewardFailure) and results[1][0].reason == "timeout"


def test_sync_rewards_that_wait_still_run_side_by_side():
    def reward(prompt, completion, **row):
        time.sleep(0.1)  # releases the GIL, as I/O does
        return 1.0

    t0 = time.monotonic()
    results = asyncio.run(
        call_reward_batch(reward, [("p", str(i), {}) for i in range(16)], timeout_s=5.0)
    )
    assert [v for v, _ in results] == [1.0] * 16
    assert time.monotonic() - t0 < 1.0  # 16 x 0.1 s one after another would take 1.6 s


def test_a_batch_after_cancelled_hung_ones_still_gets_a_worker():
    release = threading.Event()

    def reward(prompt, completion, **row):
        if completion == "hang":
            release.wait(30)
        return 1.0

    async def main():
        hung = [
            asyncio.create_task(call_reward_batch(reward, [("p", "hang", {})], timeout_s=30.0))
            for _ in range(8)
        ]
        await asyncio.sleep(0.3)
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
        t0 = time.monotonic()
        results = await call_reward_batch(reward, [("p", "ok", {})], timeout_s=0.3)
        return results, time.monotonic() - t0

    try:
        results, elapsed = asyncio.run(main())
    finally:
        release.set()
    assert results[0][0] == 1.0 and elapsed < 2.0


def test_a_fast_reward_runs_later_batches_on_one_worker_and_a_slow_one_stays_split(monkeypatch):
    """Waking four workers costs more than a batch of microsecond rewards: once a function
    is known to be fast its batches go to one worker; one that waits keeps every worker."""
    from loomrl.scoring import calls as reward_module

    submitted: list[int] = []  # worker runs handed out, per batch
    submit = reward_module._REWARD_THREADS.submit

    def counting_submit(task):
        submitted[-1] += 1
        submit(task)

    monkeypatch.setattr(reward_module._REWARD_THREADS, "submit", counting_submit)

    def fast(prompt, completion, **row):
        return 1.0

    for _ in range(3):
        submitted.append(0)
        results = asyncio.run(
            call_reward_batch(fast, [("p", str(i), {}) for i in range(64)], timeout_s=5.0)
        )
        assert [v for v, _ in results] == [1.0] * 64
    assert submitted == [min(64, reward_module._REWARD_THREADS.size), 1, 1]

    def slow(prompt, completion, **row):
        time.sleep(0.05)
        return 1.0

    # the second batch, with the function's timings known, still runs side by side
    for _ in range(2):
        submitted.append(0)
        t0 = time.monotonic()
        results = asyncio.run(
            call_reward_batch(slow, [("p", str(i), {}) for i in range(16)], timeout_s=5.0)
        )
        assert [v for v, _ in results] == [1.0] * 16
        assert time.monotonic() - t0 < 0.6  # 16 x 0.05 s one after another would take 0.8 s
    assert submitted[-1] == min(16, reward_module._REWARD_THREADS.size)
