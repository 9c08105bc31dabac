""" "Did you mean" for unknown job-file keys, and the one map of TRL's names to loomrl's.

``TRL_KEYS`` are TRL ``GRPOConfig`` (or transformers ``TrainingArguments``) names that mean a
loomrl key with the same values; ``TRL_VALUES`` those whose values are translated
(``bf16=True`` is two keys); ``TRL_NOTES`` says what to write for the rest. ``Job(...)``
takes the first two as keywords (``loomrl.job_args``); a job file or a CLI override that
uses any of them gets the hint from ``suggest``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

# TRL / transformers argument -> the loomrl key that takes the same value.
TRL_KEYS: dict[str, str] = {
    "learning_rate": "trainer.lr",
    "num_generations": "algorithm.group_size",
    "max_completion_length": "generation.max_new_tokens",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_eps",
    "epsilon_high": "algorithm.clip_eps_high",
    "loss_type": "algorithm.loss",
    "per_device_train_batch_size": "trainer.micro_batch_size",
    "max_steps": "trainer.num_steps",
    "weight_decay": "trainer.weight_decay",
    "max_grad_norm": "trainer.max_grad_norm",
    "warmup_steps": "trainer.warmup_steps",
    "lr_scheduler_type": "trainer.lr_schedule",
    "gradient_checkpointing": "trainer.gradient_checkpointing",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep",
    "eval_steps": "eval.every_steps",
    "model_name_or_path": "model.path",
    "model": "model.path",
    "train_dataset": "data.train",
    "eval_dataset": "data.eval",
    "num_completions_to_print": "logging.completions_per_step",
}


def _scale_rewards(value: Any, raw: dict) -> dict[str, Any]:
    table = {True: "std", "group": "std", False: "none", "none": "none"}
    if value not in table:
        raise ValueError(
            f"scale_rewards={value!r}: loomrl scales advantages per group ('group' or True) or not "
            "at all ('none' or False); algorithm.advantage_scale"
        )
    return {"algorithm.advantage_scale": table[value]}


def _adam_beta(index: int) -> Callable[[Any, dict], dict[str, Any]]:
    def convert(value: Any, raw: dict) -> dict[str, Any]:
        betas = list(raw.get("trainer", {}).get("betas", (0.9, 0.999)))
        betas[index] = value
        return {"trainer.betas": tuple(betas)}

    return convert


def _report_to(value: Any, raw: dict) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    return {"logging.wandb": {}} if "wandb" in names else {}


# TRL / transformers argument -> its value as loomrl keys and values (``raw``: the job so far).
TRL_VALUES: dict[str, Callable[[Any, dict], dict[str, Any]]] = {
    "scale_rewards": _scale_rewards,
    "bf16": lambda v, raw: (
        {"model.dtype": "bfloat16", "trainer.precision": "bf16_mixed"} if v else {}
    ),
    "fp16": lambda v, raw: {"model.dtype": "float16"} if v else {},
    "use_vllm": lambda v, raw: {"generation.engine": "vllm"} if v else {},
    "adam_beta1": _adam_beta(0),
    "adam_beta2": _adam_beta(1),
    "report_to": _report_to,
    "log_completions": lambda v, raw: {} if v else {"logging.completions_per_step": 0},
    "importance_sampling_level": lambda v, raw: (
        {"algorithm.loss": "gspo"} if v == "sequence" else {}
    ),
    "mask_truncated_completions": lambda v, raw: {"algorithm.overlong": "filter"} if v else {},
}

# What to write for a TRL name, where ``TRL_KEYS`` has no key of the same values.
TRL_NOTES: dict[str, str] = {
    "scale_rewards": "algorithm.advantage_scale",
    "gradient_accumulation_steps": (
        "algorithm.groups_per_step (a step trains groups_per_step x group_size completions, "
        "in micro-batches of trainer.micro_batch_size)"
    ),
    "num_train_epochs": "trainer.num_steps (loomrl counts optimizer steps)",
    "adam_beta1": "trainer.betas",
    "adam_beta2": "trainer.betas",
    "bf16": 'model.dtype = "bfloat16" and trainer.precision = "bf16_mixed"',
    "fp16": 'model.dtype = "float16"',
    "reward_funcs": "task.rewards (a [[task.rewards]] table per function)",
    "reward_weights": "the weight of each [[task.rewards]] table",
    "dataset_name": "data.train (a local file or dataset folder)",
    "use_vllm": 'generation.engine = "vllm"',
    "max_prompt_length": "data.truncate_prompts (prompts are checked against the model's context)",
    "log_completions": "logging.completions_per_step",
    "report_to": "logging (TensorBoard is always written; [logging.wandb] for W&B)",
    "logging_steps": "nothing: every step is a line of metrics.jsonl",
    "importance_sampling_level": 'algorithm.loss = "gspo" (its sequence-level ratio)',
    "mask_truncated_completions": 'algorithm.overlong = "filter"',
}

# Every TRL name with what it is in loomrl, for messages.
TRL_NAMES: dict[str, str] = {**TRL_KEYS, **TRL_NOTES}


def suggest(loc: str, paths: list[str]) -> str | None:
    """A hint for the unknown dotted key ``loc`` of a job file whose keys are ``paths``."""
    leaf = loc.rpartition(".")[2]
    if leaf in TRL_NAMES:
        return f"TRL's {leaf!r} is {TRL_NAMES[leaf]}"
    close = difflib.get_close_matches(loc, paths, n=1, cutoff=0.75)
    if not close:  # the right name in the wrong section: trainer.temperature
        by_leaf = [p for p in paths if p.rpartition(".")[2] == leaf]
        close = by_leaf[:1] or difflib.get_close_matches(
            leaf, [p.rpartition(".")[2] for p in paths], n=1, cutoff=0.8
        )
        if close and "." not in close[0]:
            close = [p for p in paths if p.endswith("." + close[0]) or p == close[0]][:1]
    return f"did you mean {close[0]}?" if close else None
