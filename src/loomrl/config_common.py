"""The sections every role reads: ``[model]``, ``[data]``, ``[algorithm]``, ``[checkpoint]``,
``[eval]`` and ``[logging]``. Each role's own section lives beside its code
(``training/config.py``, ...); ``loomrl.config_job`` puts them all together into ``JobConfig``.
A role imports these from here, not through ``loomrl.config``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config_base import DEVICE_PATTERN, DtypeName, Section


class ModelConfig(Section):
    path: str = Field(
        "tiny:llama",
        description="A local Hugging Face model folder, or a 'tiny:' spec built offline "
        "(e.g. 'tiny:llama', 'tiny:qwen2?hidden_size=128&num_layers=4').",
    )
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter instead of all weights."
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the trainer and generators compute: 'auto' (CUDA when present, else the CPU), "
        "'cpu', 'cuda' or 'cuda:<index>'.",
    )
    dtype: DtypeName = Field(
        "auto",
        description="dtype of the compute weights: the generators' model and the trainer's KL reference "
        "(the trainer's own weights follow trainer.precision). 'auto': bfloat16 where the device computes "
        "bf16 natively (CUDA; a CPU with avx512_bf16, amx_bf16 or Arm bf16), float32 elsewhere; the run's "
        "start line and summary.json say which and why. 'float32' pins fp32 (the golden record does).",
    )


class LoraConfig(Section):
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names to adapt."
    )


class DataConfig(Section):
    train: str = Field(
        ...,
        description="Training prompts: a .jsonl, .json (array or lines) or .parquet file, or a "
        "dataset folder (save_to_disk, or data files named as on the hub) (docs/data.md).",
    )
    eval: str | None = Field(None, description="Held-out prompts for evaluation (as train).")
    train_split: str = Field(
        "train", description="Split of a dataset folder data.train names (files: not read)."
    )
    eval_split: str = Field(
        "test", description="Split of a dataset folder data.eval names (files: not read)."
    )
    dataset_config: str | None = Field(
        None,
        description="Configuration (subset) of a dataset folder whose README lists several, as on "
        "the hub (datasets' name: 'main' for gsm8k); one name for data.train and data.eval.",
    )
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of {role, content} messages "
        "(TRL's conversational format; needs the chat template).",
    )
    chat_template: bool | Literal["auto"] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (with the generation prompt) "
        "and tokenize the result with no extra special tokens. 'auto': for prompts that are lists of "
        "messages, and for every prompt when system_prompt is set; false: never (a message list is then "
        "an error).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before each prompt's messages (a row that starts with a "
        "system message keeps its own); applies the chat template.",
    )
    max_eval_examples: int = Field(256, gt=0, description="Evaluate on at most this many rows.")
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch (seeded).")
    truncate_prompts: bool = Field(
        False,
        description="Cut prompts that do not fit the model's context with generation.max_new_tokens "
        "(keeping their end) instead of failing; the run log says how many were cut.",
    )
    max_prompt_bytes: int = Field(
        1 << 20,
        gt=0,
        description="A prompt longer than this many UTF-8 bytes is refused (naming its file and "
        "line) before it is tokenized; with truncate_prompts it is first cut to its last max_prompt_bytes bytes. "
        "Tokenizing a huge prompt costs ~400x its size in memory.",
    )

    def templated(self, prompt: str | list[dict[str, str]]) -> bool:
        """Whether ``prompt`` goes through the chat template (``chat_template``'s rule)."""
        if self.chat_template == "auto":
            return isinstance(prompt, list) or self.system_prompt is not None
        return bool(self.chat_template)

    def messages(self, prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """The prompt as the messages the chat template renders: a text as one user
        message, with ``system_prompt`` first (unless the prompt has its own)."""
        messages = (
            list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError(
                "data.system_prompt is put in through the chat template; data.chat_template=false "
                "leaves it out: set chat_template to 'auto' or true, or drop system_prompt"
            )
        return self


class AlgorithmConfig(Section):
    loss: Literal["pg", "grpo", "aipo", "tis", "dr_grpo", "gspo", "cispo"] = Field(
        "aipo",
        description="Policy loss (loomrl.algorithms.losses; docs/async.md's table): 'pg' is plain "
        "policy gradient with no importance weight; 'dr_grpo', 'gspo' and 'cispo' as their papers.",
    )
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    groups_per_step: int = Field(8, gt=0, description="Groups per optimizer step (B).")
    max_staleness: int = Field(
        1, ge=0, description="Max versions a rollout may lag when trained; 0 = synchronous."
    )
    delta: float = Field(
        2.0, gt=0, description="Truncation of the importance weight (AIPO/TIS/CISPO)."
    )
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (grpo/tis/dr_grpo/gspo).")
    clip_eps_low: float | None = Field(
        None,
        gt=0,
        description="Lower clip range: the ratio is clipped at 1 - clip_eps_low (None: clip_eps).",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip range: 1 + clip_eps_high (None: clip_eps); DAPO's clip-higher "
        "sets it above clip_eps_low (0.2 / 0.28).",
    )
    advantage_scale: Literal["none", "std"] = Field(
        "none", description="Divide group-centred rewards by the group's std."
    )
    aggregation: Literal["token", "sequence"] = Field("token", description="Loss averaging.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the initial model (0 = off). The frozen reference is kept "
        "in model.dtype's compute dtype (bf16 by default where bf16 is native), not as a second fp32 copy.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage) "
        "is dropped when scored (rollout/dropped_zero_variance) and the generators keep going "
        "until the step's batch is full; its prompt is set aside for the rest of the epoch.",
    )
    max_oversampling: float = Field(
        3.0,
        ge=1.0,
        description="Dynamic sampling's bound: at most (max_oversampling - 1) x groups_per_step "
        "groups dropped per step; past it the step trains on the groups it has (and says so).",
    )
    overlong: Literal["none", "filter", "soft"] = Field(
        "none",
        description="Completions cut at generation.max_new_tokens: 'filter' trains on none of "
        "their tokens (their rewards still enter the group's mean), 'soft' adds DAPO's linear "
        "penalty over the last overlong_buffer_tokens tokens to the reward (-1 at the maximum).",
    )
    overlong_buffer_tokens: int | None = Field(
        None,
        gt=0,
        description="'soft': the length of the penalty's ramp, ending at generation.max_new_tokens "
        "(None: a fifth of it, DAPO's 4096 of 20480).",
    )

    @model_validator(mode="after")
    def _loss_fits_its_options(self) -> AlgorithmConfig:
        if self.loss == "dr_grpo" and self.advantage_scale == "std":
            raise ValueError(
                "algorithm.loss='dr_grpo' does not scale advantages by the group's std (that is half "
                "of Dr. GRPO); set algorithm.advantage_scale='none' or pick another loss"
            )
        if self.loss == "dr_grpo" and self.aggregation == "sequence":
            raise ValueError(
                "algorithm.loss='dr_grpo' divides by a constant (generation.max_new_tokens), not by "
                "each sequence's length; leave algorithm.aggregation='token' or pick another loss"
            )
        return self

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(low, high)``: the ratio is clipped to ``[1 - low, 1 + high]``."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return low, high


class CheckpointConfig(Section):
    every_steps: int = Field(50, gt=0, description="Checkpoint every this many steps.")
    keep: int = Field(2, gt=0, description="Checkpoints kept (oldest deleted first).")


class EvalConfig(Section):
    every_steps: int = Field(25, gt=0, description="Evaluate every this many steps.")


class WandbConfig(Section):
    """``[logging.wandb]``: log to Weights & Biases (the table's presence turns it on)."""

    project: str = Field("loomrl", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); None: your default.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="'offline' writes under RUN_DIR/wandb with no network; `wandb sync` uploads it.",
    )
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")


class LoggingConfig(Section):
    """What the run folder records besides metrics.jsonl."""

    completions_per_step: int = Field(
        4,
        ge=0,
        description="(prompt, completion, reward) samples written to samples.jsonl (and TensorBoard "
        "text) per step: the first completion of each of this many of the step's groups, as text. 0: none.",
    )
    zero_variance_warning_every_steps: int = Field(
        20,
        gt=0,
        description="Warn when more than half of a step's groups got the same reward for every "
        "completion (nothing to learn from them), at most once every this many steps.",
    )
    logprob_mismatch_warning: float = Field(
        0.05,
        gt=0,
        description="Warn when the trainer's and the generators' log-probs of the same tokens at "
        "the same policy version differ by more than this on average (nats, "
        "train/logprob_mismatch_same_version: the training-inference mismatch of engine, kernels "
        "and precision), at most once every zero_variance_warning_every_steps steps.",
    )
    trace: bool = Field(
        True,
        description="Write trace.json: every process's spans (calls, endpoints, publishing, sandbox "
        "runs, lease waits) as Chrome trace events (Perfetto, chrome://tracing; docs/runs.md).",
    )
    wandb: WandbConfig | None = Field(
        None,
        description="Weights & Biases: every metrics record and each step's samples (a table); the "
        "run id follows the run folder, so a resume continues the W&B run. Needs `pip install wandb`.",
    )
    report: bool = Field(
        True,
        description="Write report.html at the end of the run (plots of reward, eval, throughput, "
        "staleness, the executor timeline, weight sync, failures; `loomrl report RUN_DIR` redraws it).",
    )


ModelConfig.model_rebuild()
