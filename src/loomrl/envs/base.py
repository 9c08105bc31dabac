"""Task contracts: reward functions and multi-turn environments.

A reward is a plain function ``fn(prompt: str, completion: str, **row) -> float``, sync or
async, where ``row`` holds the dataset's other columns. An environment is a small class
with ``reset`` and ``step``; the controller drives episodes with the generator, and the
tokens an environment inserts are masked out of the loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class StepResult:
    observation: str  # text appended to the conversation before the next turn ("" if done)
    reward: float  # reward for this step; an episode's reward is the sum over steps
    done: bool


class Environment(ABC):
    """A multi-turn environment. One instance serves one episode at a time.

    ``reset(row)`` returns the first prompt text; ``step(completion)`` takes the model's
    latest turn and returns the observation for the next turn, a reward and whether the
    episode is over. Either may be ``async``. ``close`` releases resources (sandboxes).
    """

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> str: ...

    @abstractmethod
    def step(self, completion: str) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources held by the environment."""
