"""Errors a user meets early, in one line, naming the bad thing: rewards that exit, bad
dataset bytes and lines, small datasets, eval failures, sandbox sizes, a broken weight
receiver, and a sandbox CLI that cannot load."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time

import pytest

from loomrl import cli
from loomrl.config import ConfigError, build_config
from loomrl.data import DatasetError, load_rows
from loomrl.job import Job
from loomrl.scoring.calls import RewardFailure, call_reward
from loomrl.telemetry.metrics import read_metrics

BASE = {"data": {"train": "t.jsonl"}, "task": {"reward": "m:f"}}


def _exits(prompt, completion, **row):
    sys.exit(3)


async def _exits_async(prompt, completion, **row):
    sys.exit(4)


@pytest.mark.parametrize("fn", [_exits, _exits_async])
def test_a_reward_that_calls_sys_exit_fails_at_once_as_raised(fn):
    t0 = time.perf_counter()
    with pytest.raises(RewardFailure, match=r"SystemExit \(it called sys.exit\([34]\)") as info:
        asyncio.run(call_reward(fn, "p", "c", {}, timeout_s=5.0))
    assert info.value.reason == "raised"  # not "timeout"
    assert time.perf_counter() - t0 < 1.0  # and no wait for the whole timeout
    # the worker still works
    assert asyncio.run(call_reward(lambda p, c: 1.0, "p", "c", {}, 5.0)) == 1.0


def test_dataset_errors_name_file_and_line_counted_from_one(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:3: not UTF-8 \(byte 0xe9 at column 16\)"):
        load_rows(path)
    path.write_text('{"prompt": "a"}\n\n{"question": "b"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:3: row has no 'prompt' column"):
        load_rows(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "b"}]), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d.parquet row 1: row has no 'prompt' column"):
        load_rows(tmp_path / "d.parquet")


def test_sandbox_sizes_are_checked_at_load_time():
    with pytest.raises(
        ConfigError, match=r"min_warm <= max_warm <= max_sandboxes, got min_warm=4, max_warm=2"
    ):
        build_config({**BASE, "sandbox": {"min_warm": 4, "max_warm": 2}})
    with pytest.raises(ConfigError, match=r"max_warm=16, max_sandboxes=8"):
        build_config({**BASE, "sandbox": {"max_sandboxes": 8}})


def fails_on_eval_rows(prompt, completion, **row):
    if row.get("held_out"):
        raise ValueError("no answer column in the eval file")
    return 0.0


def test_a_small_dataset_warns_and_eval_failures_are_counted_apart(tiny_job, tiny_data, caplog):
    train, evals = tiny_data
    train.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    evals.write_text(
        "".join(json.dumps({"prompt": f"{i}+2=", "held_out": True}) + "\n" for i in range(4))
    )
    cfg = tiny_job(
        task={"reward": "test_errors:fails_on_eval_rows"},
        trainer={"num_steps": 1},
        algorithm={"groups_per_step": 4, "max_staleness": 0},
    )
    with caplog.at_level(logging.WARNING):
        result = Job(cfg).run()
    messages = [r.getMessage() for r in caplog.records]
    assert any("has 3 rows, fewer than algorithm.groups_per_step=4" in m for m in messages)
    assert any("4 of 4 rollouts failed scoring and count as wrong answers" in m for m in messages)
    records = read_metrics(result.run_dir)
    train_keys = set().union(*(r for r in records if "train/loss" in r))
    assert not any(k.startswith("rollout/failed_") and k != "rollout/failed" for k in train_keys)
    evals_seen = [r for r in records if "eval/mean_reward" in r]
    assert evals_seen and all(r["eval/failed_raised"] == 4 for r in evals_seen)
    assert result.summary["failed"] == 0  # training rollouts: none failed


def test_a_torch_dist_receiver_whose_group_broke_says_so_instead_of_going_stale():
    from loomrl.weights.transports.base import BufferPool, TransferStats, TransportError
    from loomrl.weights.transports.inproc import UpdateStore
    from loomrl.weights.transports.torch_dist import TorchDistReceiver

    class BrokenGroup:  # the sender announced an update, then the peer went away
        class store:
            check = staticmethod(lambda keys: True)
            get = staticmethod(lambda key: b"update")

        def broadcast(self, tensor):
            raise RuntimeError("Connection closed by peer")

    receiver = object.__new__(TorchDistReceiver)  # no real process group: the group is the fake
    receiver.stats, receiver.store, receiver.pool = TransferStats(), UpdateStore(), BufferPool()
    receiver.group, receiver.stop, receiver.error = BrokenGroup(), threading.Event(), None
    receiver._run()  # returns: the group is broken
    with pytest.raises(
        TransportError, match="receiver stopped after RuntimeError: Connection closed by peer"
    ):
        receiver.receive(0)


def test_a_sandbox_cli_that_fails_to_import_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "loomrl.sandbox.cli", None)  # import raises ImportError
    assert cli.main(["sandbox", "exec", "x.py"]) == 2
    assert (
        "error: the sandbox commands could not be loaded: ModuleNotFoundError: import of loomrl.sandbox.cli"
        in capsys.readouterr().err
    )


# -- issue 41, finding 10: unclear errors ---------------------------------------------------


def test_deep_or_non_string_prompts_are_dataset_errors_naming_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n' + '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DatasetError, match=rf"{path}:2: nested too deeply"):
        load_rows(path)
    for line, shown in [
        ('{"prompt": null}', "null"),
        ('{"prompt": 3}', "an int"),
        ('{"prompt": {"a": 1}}', "a dict"),
    ]:
        path.write_text('{"prompt": "a"}\n\n' + line + "\n")
        with pytest.raises(
            DatasetError, match=rf"{path}:3: .prompt. is {shown}, expected a string"
        ):
            load_rows(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match=rf"{path}:1: row is a list, expected a JSON object"):
        load_rows(path)


def test_a_reward_that_fails_to_import_only_in_the_scorer_names_the_scorer_and_module(
    tmp_path, monkeypatch
):
    from functools import partial

    from loomrl.config import TaskConfig
    from loomrl.runtime.process import ProcessRuntime
    from loomrl.scoring.base import ScorerEndpoints
    from loomrl.scoring.calls import UserCodeError, load_object
    from loomrl.scoring.function import start_function_scorer

    cases = {
        "scorer_only_missing": (
            "import no_such_module_for_loomrl_tests",
            "No module named 'no_such_module_for_loomrl_tests'",
        ),
        "scorer_only_raises": (
            "raise RuntimeError('needs a GPU')",
            "raised RuntimeError: needs a GPU",
        ),
    }
    for name, (failure, _) in cases.items():
        (tmp_path / f"{name}.py").write_text(
            "import multiprocessing\n"
            "if multiprocessing.current_process().name.startswith('loomrl-scorer'):\n"
            f"    {failure}\n"
            "def reward(prompt, completion, **row):\n    return 0.0\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = ProcessRuntime()
    try:
        for name, (_, cause) in cases.items():
            assert callable(load_object(f"{name}:reward"))  # here (the controller) it imports
            task = TaskConfig(reward=f"{name}:reward")
            handle = runtime.start(
                "scorer0", partial(start_function_scorer, task, None), ScorerEndpoints
            )
            with pytest.raises(UserCodeError) as info:
                asyncio.run(handle.ready())
            text = str(info.value)  # what the CLI prints: one line naming the scorer and the module
            assert (
                "scorer executor 'scorer0' (pid" in text
                and f"module {name!r}" in text
                and cause in text
            ), text
    finally:
        runtime.shutdown()


async def _blocks_the_loop(prompt, completion, **row):
    time.sleep(0.6)  # not await: the event loop is stuck here
    return 1.0


def test_an_async_reward_that_blocks_the_loop_past_its_timeout_has_its_late_value_refused():
    with pytest.raises(RewardFailure, match=r"blocked the event loop.*late value refused") as info:
        asyncio.run(call_reward(_blocks_the_loop, "p", "c", {}, timeout_s=0.2))
    assert info.value.reason == "timeout"
    from loomrl.scoring.calls import call_reward_batch

    done = asyncio.run(call_reward_batch(_blocks_the_loop, [("p", "c", {})], 0.2))
    assert isinstance(done[0][0], RewardFailure) and done[0][0].reason == "timeout"
    # in time: kept
    assert asyncio.run(call_reward(_blocks_the_loop, "p", "c", {}, timeout_s=5.0)) == 1.0


def test_an_async_sandbox_exec_is_bounded_by_its_claim_timeout_and_its_own_timeout():
    from loomrl.sandbox import SandboxError, SandboxLimits, SandboxPool

    claim_s, own_s = 0.5, 1.0
    with SandboxPool(
        "process",
        min_warm=1,
        max_warm=1,
        max_sandboxes=1,
        claim_timeout_s=claim_s,
        limits=SandboxLimits(timeout_s=own_s),
    ) as pool:
        pool.exec("print(0)")  # started and warm

        async def one() -> float:
            t0 = time.monotonic()
            try:
                await pool.aexec("import time; time.sleep(0.3)")
            except SandboxError as err:
                assert "backpressure" in str(err)
            return time.monotonic() - t0

        async def burst() -> list[float]:
            return await asyncio.gather(*(one() for _ in range(40)))

        waits = asyncio.run(burst())
    assert max(waits) < claim_s + own_s + 0.5, sorted(waits)[-5:]
