"""Executor groups: N ranks behind one handle, on every runtime, with a fake two-rank
executor whose ranks meet in a gloo group at the group's rendezvous.

On ``process`` and ``ray`` each rank is its own process and joins the default
``torch.distributed`` group with ``init_method=rendezvous`` (as the sharded trainer will).
On ``local`` the ranks are threads of one process, which has one default group: each rank
builds its own ``ProcessGroupGloo`` over a ``TCPStore`` at the rendezvous instead."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import time
from functools import partial
from urllib.parse import urlsplit

import pytest

from loomrl.runtime.base import ExecutorDiedError, UnrecoverableError, role_of
from loomrl.runtime.endpoints import endpoint
from loomrl.runtime.group import ExecutorGroup, rank_name, start_group

pytestmark = pytest.mark.timeout(180)


class PairEndpoints:
    @endpoint
    def all_reduce(self, value: float, sleep_s: float = 0.0) -> tuple[int, float]: ...

    @endpoint
    def worker_pid(self) -> int: ...

    @endpoint
    def fail_on(self, rank: int) -> float: ...

    @endpoint
    def unrecoverable_on(self, rank: int) -> float: ...


class PairRank:
    """One rank: joins the gloo group in its constructor (blocking until every rank has)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: str,
        default_group: bool,
        timeout_s: float,
        broken_rank: int | None = None,
    ) -> None:
        import torch.distributed as dist

        if rank == broken_rank:
            raise FileNotFoundError(f"rank {rank}: model weights missing")
        self.rank, self.default_group = rank, default_group
        timeout = datetime.timedelta(seconds=timeout_s)
        if default_group:
            dist.init_process_group(
                "gloo", init_method=rendezvous, rank=rank, world_size=world_size, timeout=timeout
            )
            self.group = dist.group.WORLD
        else:
            address = urlsplit(rendezvous)
            self.store = dist.TCPStore(
                address.hostname, address.port, world_size, rank == 0, timeout=timeout
            )
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def all_reduce(self, value: float, sleep_s: float = 0.0) -> tuple[int, float]:
        """Every rank adds ``(rank + 1) * value``: two ranks give ``3 * value``."""
        import torch

        time.sleep(sleep_s)
        tensor = torch.tensor([(self.rank + 1) * value], dtype=torch.float64)
        if self.default_group:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        else:
            self.group.allreduce([tensor]).wait()
        return self.rank, tensor.item()

    def worker_pid(self) -> int:
        return os.getpid()

    def fail_on(self, rank: int) -> float:
        """Raises on ``rank``; the other ranks wait for it in a collective."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} cannot go on")
        return self.all_reduce(1.0)[1]

    def unrecoverable_on(self, rank: int) -> float:
        """``rank`` raises what no restart cures (as a checkpoint its peers cannot see)."""
        if self.rank == rank:
            raise UnrecoverableError(f"rank {rank}: the checkpoint folder is not shared")
        return 1.0  # (as a checkpoint's other ranks: done, no collective after it)

    def close(self) -> None:
        if self.default_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def pair_rank(
    rank: int,
    world_size: int,
    rendezvous: str,
    *,
    default_group: bool,
    timeout_s: float = 30.0,
    broken_rank: int | None = None,
) -> partial:
    """The rank factory: the (picklable) zero-argument factory of rank ``rank``."""
    return partial(PairRank, rank, world_size, rendezvous, default_group, timeout_s, broken_rank)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["local", "process", pytest.param("ray", marks=pytest.mark.ray)])
def runtime(request):
    if request.param == "local":
        from loomrl.runtime.local import LocalRuntime

        rt = LocalRuntime()
    elif request.param == "process":
        from loomrl.runtime.process import ProcessRuntime

        rt = ProcessRuntime()
    else:
        request.getfixturevalue("ray_cluster")
        from loomrl.config import RayConfig
        from loomrl.runtime.ray import RayRuntime

        rt = RayRuntime(RayConfig(num_cpus={"trainer": 0.5, "generator": 0.5}))
    rt.kind = request.param
    yield rt
    rt.shutdown()


def _start_pair(runtime, **kwargs) -> ExecutorGroup:
    factory = partial(pair_rank, default_group=runtime.kind != "local", **kwargs)
    return start_group(runtime, "trainer", factory, 2, PairEndpoints)


def test_a_call_goes_to_every_rank_and_returns_rank_0s_answer(runtime):
    group = _start_pair(runtime)

    async def main():
        await group.ready()
        return (
            await group.all_reduce(1.5),
            await group.worker_pid(),
            [await r.worker_pid() for r in group.ranks],
        )

    answer, pid, rank_pids = run(main())
    assert answer == (0, 4.5)  # rank 0's answer, and the all-reduce saw both ranks (1.5 + 2 * 1.5)
    assert [r.name for r in group.ranks] == [
        "trainer.rank0",
        "trainer.rank1",
    ] and runtime.handles == group.ranks
    assert pid == rank_pids[0] and group.pid == group.ranks[0].pid
    if runtime.kind == "local":
        assert rank_pids == [os.getpid()] * 2
    else:
        assert len(set(rank_pids)) == 2 and os.getpid() not in rank_pids
    assert group.busy_s == group.ranks[0].busy_s > 0 and group.where.endswith("rank 0 of 2")
    assert group.alive and not group.calls.running()
    # arguments are checked against the interface
    with pytest.raises(TypeError, match="all_reduce"):
        run(group.all_reduce())


@pytest.mark.parametrize(
    "runtime", ["process", pytest.param("ray", marks=pytest.mark.ray)], indirect=True
)
def test_a_killed_rank_takes_the_group_down_and_a_restart_brings_both_back(runtime):
    group = _start_pair(runtime)
    run(group.ready())
    old_pids = {r.pid for r in group.ranks}
    assert None not in old_pids

    async def main():
        pending = asyncio.ensure_future(group.all_reduce(1.0, sleep_s=30))
        await asyncio.sleep(1.0)
        os.kill(group.ranks[1].pid, signal.SIGKILL)
        return await pending

    t0 = time.monotonic()
    with pytest.raises(
        ExecutorDiedError,
        match=r"executor group 'trainer': rank 1 of 2 .*the group's other ranks were killed",
    ):
        run(main())
    assert time.monotonic() - t0 < 20  # rank 0 was killed, not waited on for its 30 s
    assert not group.alive and not group.ranks[0].alive
    with pytest.raises(ExecutorDiedError):
        run(group.worker_pid())

    fresh = runtime.restart(group)
    assert (
        isinstance(fresh, ExecutorGroup)
        and fresh is not group
        and fresh.rendezvous != group.rendezvous
    )
    assert runtime.handles == fresh.ranks  # the old ranks are forgotten
    run(fresh.ready())
    assert run(fresh.all_reduce(2.0)) == (0, 6.0)
    assert not {r.pid for r in fresh.ranks} & old_pids


def test_on_local_a_rank_that_raises_takes_the_group_down_and_a_restart_recovers():
    from loomrl.runtime.local import LocalRuntime

    runtime = LocalRuntime()
    try:
        group = start_group(
            runtime,
            "trainer",
            partial(pair_rank, default_group=False, timeout_s=3.0),
            2,
            PairEndpoints,
        )
        with pytest.raises(
            ExecutorDiedError, match=r"rank 1 of 2 .*ValueError: rank 1 cannot go on"
        ) as info:
            run(group.fail_on(1))
        assert isinstance(info.value.__cause__, ValueError)
        assert not group.alive
        with pytest.raises(ExecutorDiedError):  # at once: the group is gone
            run(group.all_reduce(1.0))
        # (waits for rank 0's collective to time out: a thread cannot be killed)
        fresh = runtime.restart(group)
        assert run(fresh.all_reduce(1.0)) == (0, 3.0) and runtime.handles == fresh.ranks
    finally:
        runtime.shutdown()


def test_a_rank_whose_error_no_restart_cures_ends_the_group_and_raises_that_error(runtime):
    # A checkpoint some rank's node cannot see (issue 54): the group is ended as for any
    # failed rank, but the call raises the error itself, so supervision does not take it for
    # a lost trainer and restart the job into the same storage, faults.max_restarts times.
    group = _start_pair(runtime)
    run(group.ready())
    with pytest.raises(UnrecoverableError, match="rank 1: the checkpoint folder is not shared"):
        run(group.unrecoverable_on(1))
    assert not group.alive or runtime.kind == "local"  # (threads cannot be killed)
    with pytest.raises(ExecutorDiedError):  # the group is gone: any later call fails at once
        run(group.all_reduce(1.0))


def test_on_local_a_rank_that_fails_to_build_fails_the_start_with_its_own_error():
    from loomrl.runtime.local import LocalRuntime

    runtime = LocalRuntime()
    factory = partial(pair_rank, default_group=False, timeout_s=2.0, broken_rank=1)
    with pytest.raises(FileNotFoundError, match="rank 1: model weights missing") as info:
        start_group(runtime, "trainer", factory, 2, PairEndpoints)
    assert "starting 'trainer.rank1'" in "\n".join(info.value.__notes__)
    assert runtime.handles == []


def test_process_a_rank_that_fails_to_build_ends_the_others():
    from loomrl.runtime.process import ProcessRuntime

    runtime = ProcessRuntime()
    try:
        group = start_group(
            runtime,
            "trainer",
            partial(pair_rank, default_group=True, broken_rank=1),
            2,
            PairEndpoints,
        )
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError, match="rank 1: model weights missing"):
            run(group.ready())
        assert time.monotonic() - t0 < 20  # rank 0, waiting at the rendezvous (30 s), was killed
        assert not group.alive and not group.ranks[0].alive
    finally:
        runtime.shutdown()


def test_rank_names_keep_the_groups_role_and_a_group_needs_a_rank():
    assert rank_name("trainer", 1) == "trainer.rank1" and role_of("trainer.rank1") == "trainer"
    assert role_of("generator12") == "generator"
    with pytest.raises(ValueError, match="world_size >= 1, got 0"):
        start_group(None, "trainer", pair_rank, 0)  # type: ignore[arg-type]


def test_supervision_kills_a_hung_group_and_restarts_all_its_ranks():
    """A rank stuck past the call's deadline (a hung collective): ``Supervised`` kills the
    group (every rank) and starts it again, as it does a single executor."""
    from loomrl.runtime.process import ProcessRuntime
    from loomrl.runtime.supervision import Deadlines, FaultStats, Supervised, TrainerLostError

    runtime = ProcessRuntime()
    try:
        group = start_group(
            runtime, "trainer", partial(pair_rank, default_group=True), 2, PairEndpoints
        )
        run(group.ready())
        old_pids = {r.pid for r in group.ranks}
        stats = FaultStats()
        slot = Supervised(runtime, group, Deadlines(min_s=2.0, first_s=2.0), stats)

        t0 = time.monotonic()
        with pytest.raises(TrainerLostError, match="ran past its deadline") as info:
            run(slot.all_reduce(1.0, sleep_s=60))
        assert info.value.restarted and time.monotonic() - t0 < 40
        assert stats.hung_kills == 1 and stats.restarts["trainer"] == 1
        assert (
            isinstance(slot.handle, ExecutorGroup) and slot.handle is not group and not group.alive
        )
        assert run(slot.all_reduce(2.0)) == (0, 6.0)
        assert (
            not {r.pid for r in slot.handle.ranks} & old_pids
            and runtime.handles == slot.handle.ranks
        )
    finally:
        runtime.shutdown()
