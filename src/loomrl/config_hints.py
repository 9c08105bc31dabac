""" "Did you mean" for unknown job-file keys: the loomrl key for a TRL ``GRPOConfig`` (or
transformers ``TrainingArguments``) name, else the closest key by spelling."""

from __future__ import annotations

import difflib

# TRL / transformers argument -> what to write in a loomrl job file.
TRL_NAMES: dict[str, str] = {
    "learning_rate": "trainer.lr",
    "num_generations": "algorithm.group_size",
    "max_completion_length": "generation.max_new_tokens",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_eps",
    "epsilon_high": "algorithm.clip_eps_high",
    "importance_sampling_level": 'algorithm.loss = "gspo" (its sequence-level ratio)',
    "mask_truncated_completions": 'algorithm.overlong = "filter"',
    "loss_type": "algorithm.loss",
    "scale_rewards": "algorithm.advantage_scale",
    "per_device_train_batch_size": "trainer.micro_batch_size",
    "gradient_accumulation_steps": (
        "algorithm.groups_per_step (a step trains groups_per_step x group_size completions, "
        "in micro-batches of trainer.micro_batch_size)"
    ),
    "max_steps": "trainer.num_steps",
    "num_train_epochs": "trainer.num_steps (loomrl counts optimizer steps)",
    "weight_decay": "trainer.weight_decay",
    "max_grad_norm": "trainer.max_grad_norm",
    "adam_beta1": "trainer.betas",
    "adam_beta2": "trainer.betas",
    "warmup_steps": "trainer.warmup_steps",
    "lr_scheduler_type": "trainer.lr_schedule",
    "gradient_checkpointing": "trainer.gradient_checkpointing",
    "bf16": 'model.dtype = "bfloat16" and trainer.precision = "bf16_mixed"',
    "fp16": 'model.dtype = "float16"',
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep",
    "eval_steps": "eval.every_steps",
    "model_name_or_path": "model.path",
    "model": "model.path",
    "reward_funcs": "task.rewards (a [[task.rewards]] table per function)",
    "reward_weights": "the weight of each [[task.rewards]] table",
    "train_dataset": "data.train",
    "eval_dataset": "data.eval",
    "dataset_name": "data.train (a local file or dataset folder)",
    "use_vllm": 'generation.engine = "vllm"',
    "max_prompt_length": "data.truncate_prompts (prompts are checked against the model's context)",
    "log_completions": "logging.completions_per_step",
    "num_completions_to_print": "logging.completions_per_step",
    "report_to": "logging (TensorBoard is always written)",
}


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
