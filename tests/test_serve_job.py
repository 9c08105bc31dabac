"""``task.agent`` end to end: a tiny job whose rollouts come from ``openai``-client agents
talking to the job's endpoint; the trained tokens are the sampled ones, non-extending
requests become samples of their own, and failing agents fail only their episodes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from loomrl.job import Job
from loomrl.training.executor import TrainerExecutor


@pytest.fixture
def trained(monkeypatch):
    rows: list = []
    real_step = TrainerExecutor.train_step

    def recording_step(self, groups, publish=False):
        rows.extend(r for g in groups for r in g)
        return real_step(self, groups, publish)

    monkeypatch.setattr(TrainerExecutor, "train_step", recording_step)
    return rows


def _accounting_holds(s: dict) -> None:
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["prompts_trained_twice"] == 0


def test_a_three_request_episode_trains_on_exactly_the_sampled_tokens(tiny_job, trained):
    import serve_agents

    serve_agents.SEEN.clear()
    cfg = tiny_job(
        task={"reward": None, "agent": "serve_agents:three_requests"}, trainer={"num_steps": 2}
    )
    result = Job(cfg).run()
    _accounting_holds(result.summary)
    assert len(trained) == 2 * 4 * 4
    for r in trained:
        assert r.num_turns == 3
        answers = [t for t, m in zip(r.completion_ids, r.loss_mask) if m]
        logprobs = [lp for lp, m in zip(r.behaviour_logprobs, r.loss_mask) if m]
        matches = [
            seen
            for seen in serve_agents.SEEN[r.prompt]
            if answers == [t for ids, _ in seen for t in ids]
            and logprobs == [lp for _, lps in seen for lp in lps]
        ]
        assert matches and r.reward == float(len(matches[0][-1][0]))
    run_dir = result.run_dir
    assert stat.S_IMODE((run_dir / "serve_token").stat().st_mode) == 0o600
    assert json.loads((run_dir / "serve.json").read_text())["url"].startswith("http://127.0.0.1:")
    assert result.eval_history and "eval/mean_reward" in result.eval_history[-1]


def test_non_extending_requests_become_samples_sharing_the_reward(tiny_job, trained):
    cfg = tiny_job(
        task={"reward": None, "agent": "serve_agents:rewrites_history"}, trainer={"num_steps": 1}
    )
    result = Job(cfg).run()
    _accounting_holds(result.summary)
    # each of the 4 groups: 4 episodes of 2 samples each
    assert len(trained) == 4 * 4 * 2
    assert {r.reward for r in trained} == {1.0}
    assert all(r.num_turns == 1 for r in trained)


def test_an_agent_that_returns_nothing_is_scored_by_the_tasks_reward(tiny_job, trained):
    cfg = tiny_job(
        task={"agent": "serve_agents:leaves_scoring_to_the_task"}, trainer={"num_steps": 1}
    )
    result = Job(cfg).run()
    _accounting_holds(result.summary)
    assert len(trained) == 16 and all(r.reward in (0.0, 1.0) for r in trained)


@pytest.mark.parametrize("agent", ["raises_on_odd", "hangs_on_odd"])
def test_an_agent_that_raises_or_hangs_fails_only_its_episode(tiny_job, trained, agent):
    from loomrl.telemetry.metrics import read_metrics

    cfg = tiny_job(
        task={"reward": None, "agent": f"serve_agents:{agent}", "max_failure_rate": 1.0},
        serve={"episode_timeout_s": 2.0},
        trainer={"num_steps": 2},
    )
    result = Job(cfg).run()
    s = result.summary
    _accounting_holds(s)
    assert s["failed"] > 0 and s["trained"] > 0
    kind = "raised" if agent == "raises_on_odd" else "timeout"
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert steps[-1][f"agent/failed_{kind}"] >= 1


def _harness(run_dir, stop, seen: dict) -> None:
    """A harness in its own thread (as another process would): claims episodes, runs two
    chat turns with the sync client, closes every one but each fifth (left to the deadline)."""
    import time

    import httpx
    import openai

    from loomrl.serve.server import read_run_files

    while not stop.is_set() and read_run_files(run_dir) is None:
        time.sleep(0.05)
    info = read_run_files(run_dir)
    from loomrl.telemetry.run_status import format_status, run_status

    while not stop.is_set() and "status" not in seen:
        if (run_dir / "metrics.jsonl").exists():
            seen["status"] = run_status(run_dir)
            seen["status_text"] = format_status(seen["status"])
        time.sleep(0.05)
    auth = {"Authorization": f"Bearer {info['token']}"}
    root = info["url"].removesuffix("/v1")
    while not stop.is_set():
        try:
            opened = httpx.post(info["url"] + "/episodes", headers=auth, timeout=10).json()
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        if "id" not in opened:
            continue
        client = openai.OpenAI(
            base_url=root + opened["base_path"], api_key=info["token"], max_retries=0
        )
        try:
            messages = [{"role": "user", "content": opened["row"]["prompt"]}]
            first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
            seen["requests"] = seen.get("requests", 0) + 1
            seen["episodes"] = seen.get("episodes", 0) + 1
            if seen["episodes"] % 5 == 0:
                continue
            reward = float(len(first.choices[0].message.content or ""))
            httpx.post(
                f"{info['url']}/episodes/{opened['id']}/reward",
                json={"reward": reward},
                headers=auth,
            )
        except (httpx.HTTPError, openai.OpenAIError):
            continue


def test_an_external_harness_runs_the_episodes_and_one_that_never_closes_cannot_stall(
    tiny_job, trained
):
    import threading

    cfg = tiny_job(
        task={"reward": None, "agent": "external", "max_failure_rate": 1.0},
        serve={"episode_deadline_s": 3.0},
        trainer={"num_steps": 2},
        eval={"every_steps": 100},
        data={"eval": None},
    )
    stop, seen = threading.Event(), {}
    harness = threading.Thread(target=_harness, args=(Path(cfg.output_dir), stop, seen))
    harness.start()
    try:
        result = Job(cfg).run()
    finally:
        stop.set()
        harness.join(timeout=30)
    s = result.summary
    _accounting_holds(s)
    assert s["trained"] == len(trained) > 0 and s["failed"] > 0
    assert seen["episodes"] >= s["trained"]
    token = (Path(cfg.output_dir) / "serve_token").read_text().strip()
    assert seen["status"]["endpoint"]["token"] == token
    assert f"token         {token}" in seen["status_text"]


def test_hundreds_of_concurrent_episodes_lose_and_double_no_request(tiny_job, trained):
    """256 episodes at once (16 prompts of 16) through one generator: every rollout
    accounted for, none trained twice, every request answered once."""
    from loomrl.telemetry.metrics import read_metrics

    cfg = tiny_job(
        task={"reward": None, "agent": "serve_agents:three_requests"},
        algorithm={"group_size": 16, "groups_per_step": 16, "max_staleness": 0},
        generation={"max_new_tokens": 3, "prompts_per_request": 16},
        trainer={"num_steps": 1, "micro_batch_size": 64},
        eval={"every_steps": 100},
        data={"eval": None},
    )
    result = Job(cfg).run()
    s = result.summary
    _accounting_holds(s)
    assert s["trained"] == len(trained) == 256 and s["failed"] == 0
    record = [r for r in read_metrics(result.run_dir) if "train/loss" in r][-1]
    assert record["serve/requests"] == 3 * 256
    assert record["serve/failed_requests"] == 0
