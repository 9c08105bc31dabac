"""The task's sections: what scores a completion (``task.reward``, ``[[task.rewards]]``, or a
``[task.scorer]`` table tagged by ``type``: function, model, judge) and the task's limits."""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from loomrl.config_base import DEVICE_PATTERN, DtypeName, Section


class FunctionScorerConfig(Section):
    """``[task.scorer] type = "function"``: a reward function, as ``task.reward`` names one."""

    type: Literal["function"] = Field("function", description="A Python reward function.")
    path: str = Field(
        ...,
        description="Reward function by import path 'module:function', called as fn(prompt, completion, **row) "
        "-> float (sync or async); the same as task.reward = path.",
    )


class ModelScorerConfig(Section):
    """``[task.scorer] type = "model"``: a frozen Hugging Face sequence-classification reward model."""

    type: Literal["model"] = Field(
        "model", description="A reward model (AutoModelForSequenceClassification)."
    )
    path: str = Field(
        ...,
        description="A local Hugging Face reward-model folder (num_labels == 1), with its tokenizer.",
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the scorer executor runs the model: 'auto' (CUDA when present, else the CPU), 'cpu', "
        "'cuda' or 'cuda:<index>'.",
    )
    dtype: DtypeName = Field(
        "auto", description="The model's dtype: 'auto' is bfloat16 on CUDA, float32 on the CPU."
    )
    max_tokens_per_batch: int = Field(
        8192,
        gt=0,
        description="A forward's padded tokens at most (rows x longest row); a longer row goes alone.",
    )
    normalize: bool = Field(
        False,
        description="Score as (score - running mean) / running std, over the scores this executor has seen.",
    )
    clip: float | None = Field(
        None, gt=0, description="Clip scores (after normalize) to [-clip, clip]; None: no clip."
    )


class JudgeScorerConfig(Section):
    """``[task.scorer] type = "judge"``: a frozen generative judge, read by a parser."""

    type: Literal["judge"] = Field("judge", description="A generative judge.")
    path: str = Field(
        ..., description="The judge: a local Hugging Face causal LM folder or a 'tiny:' spec."
    )
    prompt_template: str = Field(
        ...,
        description="The judge's prompt, a Python format string over {prompt}, {completion} and the row's columns.",
    )
    parser: str = Field(
        ...,
        description="Import path 'module:function' taking the judge's text and returning a float; raising or "
        "returning None marks the judgement unparsed (a counted scoring failure, judge_unparsed).",
    )
    max_new_tokens: int = Field(
        32, gt=0, description="Tokens the judge generates per judgement at most (greedy)."
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the judge runs (as task.scorer.device).",
    )
    dtype: DtypeName = Field(
        "auto", description="The judge's dtype: 'auto' is bfloat16 on CUDA, float32 on the CPU."
    )
    max_tokens_per_batch: int = Field(
        8192,
        gt=0,
        description="A generate call's padded prompt tokens at most (rows x longest prompt).",
    )

    @model_validator(mode="after")
    def _template_parses(self) -> JudgeScorerConfig:
        try:
            list(string.Formatter().parse(self.prompt_template))
        except ValueError as err:
            raise ValueError(
                f"task.scorer.prompt_template {self.prompt_template!r} is not a Python format "
                f"string: {err}"
            ) from None
        return self


class RewardSpec(Section):
    """One of ``[[task.rewards]]``: a reward function, or a reward model or judge
    (``[task.rewards.scorer]``), and its weight in the total."""

    path: str | None = Field(
        None, description="Reward function by import path 'module:function' (or give 'scorer')."
    )
    scorer: Annotated[ModelScorerConfig | JudgeScorerConfig, Field(discriminator="type")] | None = (
        Field(
            None,
            description="A reward model (type = 'model') or judge (type = 'judge') as this part, "
            "in place of 'path'; it runs in the scorer executors with the list's functions.",
        )
    )
    weight: float = Field(1.0, description="Its weight in the total reward (the weighted sum).")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name in the metrics (reward/<name>_mean); default: the function's name.",
    )
    signature: Literal["auto", "loomrl", "trl"] = Field(
        "auto",
        description="'loomrl': fn(prompt, completion, **row) -> float; 'trl': TRL's batched "
        "fn(prompts, completions, **columns) -> list[float]; 'auto': 'trl' when the function has a "
        "parameter named 'completions', else 'loomrl'.",
    )

    @model_validator(mode="after")
    def _function_or_scorer(self) -> RewardSpec:
        if (self.path is None) == (self.scorer is None):
            raise ValueError(
                "a [[task.rewards]] entry needs exactly one of 'path' (a function) or 'scorer' "
                f"(a model or judge table), got {'both' if self.path else 'neither'}"
            )
        if self.scorer is not None and self.signature != "auto":
            raise ValueError(f"signature={self.signature!r} is for a function, not a scorer part")
        return self

    @property
    def label(self) -> str:
        """The name in the metrics."""
        if self.name:
            return self.name
        return self.path.rpartition(":")[2] if self.path else self.scorer.type


ScorerConfig = Annotated[
    FunctionScorerConfig | ModelScorerConfig | JudgeScorerConfig, Field(discriminator="type")
]


class ChatEpisodeConfig(Section):
    """``[task.chat]``: how a chat environment's episodes run (``loomrl.envs.chat``): the
    tool-call format, the limits that end an episode or cut a tool's answer, and what to do
    with a chat template that rewrites earlier turns."""

    tool_parser: str = Field(
        "hermes",
        description="How tool calls are read from the model's text: 'hermes' (Qwen/Hermes "
        "<tool_call>{json}</tool_call>), 'llama3_json' or 'mistral' ([TOOL_CALLS]).",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="A tool call past this answers the model with a timeout error."
    )
    max_tool_result_tokens: int = Field(
        512, gt=0, description="A tool's answer is cut to this many tokens, with a marker."
    )
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        description="Prompt plus every turn and observation of one episode; an episode that "
        "reaches it ends (reason max_episode_tokens). None: the model's context.",
    )
    per_turn_samples: bool = Field(
        False,
        description="The fallback for a chat template that rewrites earlier turns: train each "
        "turn as its own sample (its prompt the template's rendering of the conversation so "
        "far), every turn with the episode's reward. Off: such a template stops the job, "
        "named, at its first episode.",
    )


class TaskConfig(Section):
    reward: str | None = Field(
        None,
        description="Reward function by import path 'module:function', called as "
        "fn(prompt, completion, **row) -> float (sync or async); TRL's batched signature "
        "fn(prompts, completions, **columns) -> list[float] is detected by its 'completions' parameter.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Several reward functions ([[task.rewards]] tables of path, weight, "
        "name, signature) in place of 'reward': the reward is their weighted sum, each logged as "
        "reward/<name>_mean; a failure of any one fails the rollout.",
    )
    environment: str | None = Field(
        None, description="Multi-turn Environment class by import path 'module:Class'."
    )
    scorer: ScorerConfig | None = Field(
        None,
        description="A scorer table instead of task.reward: type = 'function' (path), 'model' (a reward "
        "model folder) or 'judge' (a generative judge and its parser); see docs/scoring.md.",
    )
    agent: str | None = Field(
        None,
        description="An agent function by import path 'module:function', run as "
        "`await fn(client, row)` group_size times per prompt, client an openai.AsyncOpenAI bound "
        "to the job's endpoint and that episode; it returns the reward, a dict with 'reward' and "
        "metrics, or None (task.reward then scores the final answer); see docs/serve.md.",
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the Environment class."
    )
    max_turns: int = Field(4, gt=0, description="Turns per episode for multi-turn environments.")
    chat: ChatEpisodeConfig = Field(
        default_factory=ChatEpisodeConfig,
        description="Chat environments' episodes: tool-call parser, limits, template fallback.",
    )
    reward_timeout_s: float = Field(10.0, gt=0, description="A reward call past this fails.")
    max_failure_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the job when more than this fraction of the last "
        "`failure_window` rollouts failed scoring.",
    )
    failure_window: int = Field(256, gt=0, description="Rollouts in the failure-rate window.")
    num_scorers: int = Field(
        1,
        gt=0,
        description="Scorer executors that run the reward function (and its sandboxes), "
        "placed by the runtime; the controller load-balances reward batches over them.",
    )

    @property
    def has_reward(self) -> bool:
        """Whether a reward function, list or scorer table scores completions (an
        environment scores in its episodes; an agent may return its own rewards)."""
        return bool(self.reward or self.rewards or self.scorer)

    @model_validator(mode="after")
    def _one_scorer(self) -> TaskConfig:
        if self.reward is not None and self.rewards:
            raise ValueError(
                "task.reward and task.rewards both set: list the single reward in task.rewards too"
            )
        given = [
            name for name in ("reward", "rewards", "environment", "scorer") if getattr(self, name)
        ]
        if self.agent is not None:
            if self.environment is not None or len(given) > 1:
                raise ValueError(
                    "task.agent runs its own episodes: give at most a reward (task.reward, "
                    f"task.rewards or task.scorer) for the answers it leaves unscored, got {given}"
                )
        elif len(given) != 1:
            raise ValueError(
                f"task needs exactly one of 'reward' or 'environment' (or 'rewards' in place of "
                f"'reward', or a 'scorer' table), got {' and '.join(map(repr, given)) or 'none'}"
            )
        labels = [spec.label for spec in self.rewards]
        if len(set(labels)) < len(labels):
            raise ValueError(f"task.rewards names repeat ({labels}): give each a distinct 'name'")
        return self
