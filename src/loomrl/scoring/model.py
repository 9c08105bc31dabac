"""``[task.scorer] type = "model"``: a frozen reward model as a scorer executor.

The model is a local Hugging Face sequence-classification folder (the layout of common open
reward models: ``AutoModelForSequenceClassification`` with ``num_labels == 1``) with its own
tokenizer. A (prompt, completion) pair is the conversation ``[user: prompt, assistant:
completion]`` through the tokenizer's chat template when it has one, else the text
``prompt + completion``; the score is the model's one logit at the last token that is not
padding. Pairs run in batches of at most ``max_tokens_per_batch`` padded tokens, right-padded
with an attention mask, so a pair scores the same alone or in a batch (up to float order).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from loomrl.scoring.base import ScoreItem
from loomrl.scoring.batched import BatchedModelScorer, load_frozen, resolve_placement
from loomrl.scoring.calls import RewardFailure
from loomrl.scoring.config import ModelScorerConfig

logger = logging.getLogger(__name__)


class ModelScorerError(ValueError):
    """A reward-model folder that cannot score (not there, or not one logit)."""


def load_reward_model(path: str, device: Any = "cpu", dtype: Any = None):
    """``(model, tokenizer)`` of a reward-model folder, frozen on ``device``; the tokenizer
    pads (with its EOS where it has no pad token), and the model knows that pad id."""
    # lazy: torch loads when this runs, not with the module
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelScorerError(
            f"task.scorer.path {path!r} is not a local Hugging Face model folder (no config.json)"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    )
    if model.config.num_labels != 1:
        raise ModelScorerError(
            f"task.scorer.path {path!r} has num_labels={model.config.num_labels}; a reward model "
            "gives one score (num_labels == 1)"
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return load_frozen(model, device, dtype or torch.float32), tokenizer


def reward_model_text(tokenizer, prompt: str, completion: str) -> tuple[str, bool]:
    """The text the reward model reads for a pair, and whether the tokenizer should add its
    special tokens (a chat template writes its own)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return tokenizer.apply_chat_template(messages, tokenize=False), False
    return prompt + completion, True


class RewardModelScorer(BatchedModelScorer):
    """Scores each (prompt, completion) with a frozen reward model."""

    def __init__(self, cfg: ModelScorerConfig) -> None:
        # lazy: transformers loads in the scorer executor, not when the job is assembled
        from loomrl.models.loading import model_context_length

        super().__init__()
        self.cfg = cfg
        self.max_tokens_per_batch, self.normalize, self.clip = (
            cfg.max_tokens_per_batch,
            cfg.normalize,
            cfg.clip,
        )
        self.device, dtype = resolve_placement(cfg)
        self.model, self.tokenizer = load_reward_model(cfg.path, self.device, dtype)
        self.max_length = model_context_length(cfg.path)
        logger.info(
            "reward model %s on %s (%s), %d-token batches",
            cfg.path,
            self.device,
            dtype,
            cfg.max_tokens_per_batch,
        )

    def encode(self, item: ScoreItem) -> list[int]:
        text, special = reward_model_text(self.tokenizer, item[0], item[1])
        ids = self.tokenizer(text, add_special_tokens=special).input_ids
        if self.max_length is not None and len(ids) > self.max_length:
            raise RewardFailure(
                "too_long",
                f"the reward model reads at most {self.max_length} tokens; this "
                f"prompt and completion are {len(ids)}",
            )
        return ids

    def score_batch(
        self, ids: list[list[int]], items: list[ScoreItem]
    ) -> list[float | RewardFailure]:
        # lazy: torch loads when this runs, not with the module
        import torch

        longest = max(map(len, ids))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor(
            [row + [pad] * (longest - len(row)) for row in ids], device=self.device
        )
        mask = torch.tensor(
            [[1] * len(row) + [0] * (longest - len(row)) for row in ids], device=self.device
        )
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits  # [batch, 1]
        return logits[:, 0].float().tolist()
