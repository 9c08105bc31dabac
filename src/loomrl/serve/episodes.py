"""Episodes: the requests of one agent run, recorded, and the samples training takes from them.

An episode is opened (by loomrl for a ``task.agent`` function, or by a harness with ``POST
/v1/episodes``), its requests are tagged with its id, and it is closed with a reward (or
failed). Every sampled answer of a tagged request is recorded in order.

The samples (``merge_calls``): when each request's prompt is exactly the previous prompt
plus the previous answer plus new tokens (an agent that sends the whole conversation back,
rendered the same way), the episode is one sample: the first prompt, then every answer
(trained on, ``loss_mask`` 1, with its behaviour log-probs) and every inserted stretch
between them (tool output, the next user turn: ``loss_mask`` 0). A request that does not
extend the one before (the conversation was cut or rewritten, or the chat template renders
an earlier answer differently from how it was sampled) starts a new sample; an episode's
samples share its reward, and the starts are counted (``agent/split_samples``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from loomrl.serve.protocol import SampledChoice


class EpisodeError(Exception):
    """A request for an episode that cannot take it; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Episode:
    id: str
    row: dict[str, Any]
    deadline: float  # time.monotonic() past which it is closed as failed
    calls: list[SampledChoice] = field(default_factory=list)
    closed: asyncio.Future | None = None  # the reward (or the failure), once closed
    messages: list[dict[str, Any]] = field(default_factory=list)  # the last chat request's


@dataclass
class Sample:
    """One training sample of an episode: token-exact, as ``Rollout`` holds it."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    num_turns: int = 0

    def add(self, inserted: list[int], call: SampledChoice) -> None:
        self.completion_ids += inserted + call.token_ids
        self.logprobs += [0.0] * len(inserted) + call.logprobs
        self.loss_mask += [0] * len(inserted) + [1] * len(call.token_ids)
        self.versions.append(call.version)
        self.finish_reason = call.finish_reason
        self.num_turns += 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def merge_calls(calls: list[SampledChoice]) -> list[Sample]:
    """The samples of an episode's calls, in order (module docstring)."""
    samples: list[Sample] = []
    for call in calls:
        if samples:
            seen = samples[-1].all_ids
            if call.prompt_ids[: len(seen)] == seen:
                samples[-1].add(call.prompt_ids[len(seen) :], call)
                continue
        sample = Sample(prompt_ids=list(call.prompt_ids))
        sample.add([], call)
        samples.append(sample)
    return samples


class EpisodeBook:
    """The open episodes of one endpoint, by id; closed ones are refused (409), unknown ones
    too (404), each with a message that says which."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.open: dict[str, Episode] = {}
        self.recent_closed: dict[str, str] = {}  # id -> how it closed, for a clear refusal
        self.num_opened = 0
        self.num_expired = 0

    def start(self, row: dict[str, Any] | None = None, deadline_s: float | None = None) -> Episode:
        episode_id = "ep-" + secrets.token_hex(12)
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        episode = Episode(episode_id, dict(row or {}), deadline)
        episode.closed = asyncio.get_running_loop().create_future()
        self.open[episode_id] = episode
        self.num_opened += 1
        return episode

    def get(self, episode_id: str) -> Episode:
        """The open episode ``episode_id``, or ``EpisodeError`` saying why not."""
        self.expire()
        episode = self.open.get(episode_id)
        if episode is not None:
            return episode
        if episode_id in self.recent_closed:
            raise EpisodeError(
                409,
                f"episode {episode_id!r} is closed ({self.recent_closed[episode_id]}); open a new one",
            )
        raise EpisodeError(404, f"no episode {episode_id!r} (open one with POST /v1/episodes)")

    def close(self, episode_id: str, outcome: Any, how: str) -> Episode:
        """Close ``episode_id`` with ``outcome`` (a reward, a dict, or an exception)."""
        return self._close(self.get(episode_id), outcome, how)

    def _close(self, episode: Episode, outcome: Any, how: str) -> Episode:
        episode_id = episode.id
        del self.open[episode_id]
        if len(self.recent_closed) > 100_000:
            self.recent_closed.clear()
        self.recent_closed[episode_id] = how
        if episode.closed is not None and not episode.closed.done():
            if isinstance(outcome, BaseException):
                episode.closed.set_exception(outcome)
            else:
                episode.closed.set_result(outcome)
        return episode

    def expire(self) -> None:
        """Close, as failed, every episode past its deadline."""
        now = time.monotonic()
        for episode_id in [k for k, e in self.open.items() if e.deadline < now]:
            self.num_expired += 1
            self._close(
                self.open[episode_id],
                TimeoutError(f"episode {episode_id} passed its deadline without a reward"),
                "deadline passed",
            )
