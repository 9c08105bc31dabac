"""A generator lost under open requests: each request is answered once, by a retry on the
generator the job routes to next, or failed cleanly (503) when that one is lost too."""

from __future__ import annotations

import asyncio

import openai
import pytest
from serve_helpers import MODEL, make_state, serving

from loomrl.models import build_char_tokenizer
from loomrl.runtime.supervision import ExecutorLostError
from loomrl.types import GenerationResult


class LosingGenerators:
    """Generators of which the first ``losses`` calls die mid-call (as a kill -9 does)."""

    def __init__(self, losses: int) -> None:
        self.losses, self.calls = losses, []

    async def __call__(self, requests):
        self.calls.append(len(requests))
        await asyncio.sleep(0.01)
        if len(self.calls) <= self.losses:
            raise ExecutorLostError("generator0 died (killed)", "generator", restarted=True)
        return [
            GenerationResult.from_columns(
                [[5, 6]] * r.num_samples,
                [[-0.1, -0.2]] * r.num_samples,
                ["length"] * r.num_samples,
                None,
                7,
            )
            for r in requests
        ]


@pytest.mark.parametrize("losses", [1, 2])
def test_requests_open_when_a_generator_dies_are_answered_once_or_failed_cleanly(losses):
    async def main():
        generators = LosingGenerators(losses)
        state = make_state(generators, build_char_tokenizer(), window_s=0.05)
        async with serving(state) as (url, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
            asks = [
                client.completions.create(model=MODEL, prompt=f"{i}", max_tokens=2)
                for i in range(8)
            ]
            done = await asyncio.gather(*asks, return_exceptions=True)
        return generators.calls, done, state.policy.batcher

    calls, done, batcher = asyncio.run(main())
    if losses == 1:
        assert calls == [8, 8] and batcher.num_retries == 1
        assert all(d.model_extra["loomrl"]["choices"][0]["token_ids"] == [5, 6] for d in done)
    else:
        assert calls == [8, 8] and batcher.num_failed == 8
        assert all(isinstance(d, openai.InternalServerError) and d.status_code == 503 for d in done)
        assert "died" in str(done[0])


@pytest.mark.slow
def test_kill_9_of_a_generator_under_open_agent_requests(tiny_job, tmp_path):
    """runtime='process': generator0 is killed (SIGKILL) at step 3 while agents have
    requests open; the call is asked again of the fresh generator, every request is answered
    once, and the job completes with its accounting exact."""
    import multiprocessing
    import os
    import signal

    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    cfg = tiny_job(
        runtime="process",
        task={"reward": None, "agent": "serve_agents:three_requests"},
        trainer={"num_steps": 6},
        checkpoint={"every_steps": 2},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0},
        eval={"every_steps": 100},
        data={"eval": None},
    )
    killed = []

    def on_record(record):
        if record.get("step") == 3 and "train/loss" in record and not killed:
            (proc,) = [
                p for p in multiprocessing.active_children() if p.name == "loomrl-generator0"
            ]
            killed.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)

    result = Job(cfg).run(on_record=on_record)
    s = result.summary
    assert killed and s["steps"] == 6
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["prompts_trained_twice"] == 0 and s["failed"] == 0
    assert s["faults"]["executor/generator_restarts"] == 1
    last = [r for r in read_metrics(result.run_dir) if "train/loss" in r][-1]
    assert last["serve/retried_calls"] >= 1 and last["serve/failed_requests"] == 0
