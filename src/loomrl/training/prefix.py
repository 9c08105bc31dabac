"""Training forward with the prompt computed once per group, not once per completion.

In GRPO-style RL every prompt is completed ``group_size`` times, and the trainer's forward
over ``prompt + completion`` repeats the prompt's positions for each completion. With short
completions the prompt is most of the work (the arithmetic demo: 7 prompt positions, 4
completion positions, 8 completions per prompt). Here each distinct prompt runs once, its
key/value cache is repeated for the rows that share it, and the completions run on top of
it. Gradients flow back through the shared cache into the one prompt forward, so the loss
and its gradient are those of the full forward, up to floating-point order (about 1e-5 in
log-probs on the demo model).

Rows of one micro-batch may have different prompts and lengths: prompts are right-padded,
their pad positions masked out of the completions' attention.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loomrl.models.cache import repeat_cache
from loomrl.types import Rollout


@dataclass
class PrefixBatch:
    prefix_ids: torch.Tensor  # [prompts, P] distinct prompts, right-padded
    prefix_attn: torch.Tensor  # [prompts, P]
    prefix_len: torch.Tensor  # [prompts]
    owner: torch.Tensor  # [rows] index of each row's prompt
    suffix_ids: torch.Tensor  # [rows, S] completion tokens, right-padded
    suffix_attn: torch.Tensor  # [rows, S]
    target_mask: torch.Tensor  # [rows, S] 1 where a completion token is trained
    behaviour: torch.Tensor  # [rows, S] behaviour log-probs of those tokens
    advantages: torch.Tensor  # [rows]
    same_version: torch.Tensor  # [rows] bool: rollout version == trainer version

    def to(self, device: torch.device) -> PrefixBatch:
        return PrefixBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def num_prompts(self) -> int:
        return self.prefix_ids.shape[0]


def build_prefix_batch(rollouts: list[Rollout], advantages: list[float], version: int, pad_id: int) -> PrefixBatch:
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(r.prompt_ids), len(index)) for r in rollouts]
    prompts = list(index)
    width = max(len(p) for p in prompts)
    prefix_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    prefix_attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        prefix_ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        prefix_attn[row, : len(p)] = 1
    n, s = len(rollouts), max(max(len(r.completion_ids) for r in rollouts), 1)
    suffix_ids = torch.full((n, s), pad_id, dtype=torch.long)
    suffix_attn = torch.zeros((n, s), dtype=torch.long)
    target_mask = torch.zeros((n, s), dtype=torch.float32)
    behaviour = torch.zeros((n, s), dtype=torch.float32)
    for row, r in enumerate(rollouts):
        k = len(r.completion_ids)
        if k:
            suffix_ids[row, :k] = torch.tensor(r.completion_ids, dtype=torch.long)
            suffix_attn[row, :k] = 1
            target_mask[row, :k] = torch.tensor(r.loss_mask, dtype=torch.float32)
            behaviour[row, :k] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
    return PrefixBatch(
        prefix_ids, prefix_attn, prefix_attn.sum(1), torch.tensor(owner), suffix_ids, suffix_attn, target_mask,
        behaviour, torch.tensor(advantages, dtype=torch.float32), torch.tensor([r.version == version for r in rollouts]),
    )


def prefix_logits(model: torch.nn.Module, batch: PrefixBatch) -> torch.Tensor:
    """Logits ``[rows, S, vocab]``: position ``j`` predicts completion token ``j``."""
    out = model(input_ids=batch.prefix_ids, attention_mask=batch.prefix_attn, use_cache=True)
    last = out.logits[torch.arange(batch.num_prompts, device=batch.owner.device), batch.prefix_len - 1]  # predicts the first token
    first = last.index_select(0, batch.owner).unsqueeze(1)
    if batch.suffix_ids.shape[1] == 1:
        return first
    inputs = batch.suffix_ids[:, :-1]
    positions = batch.prefix_len.index_select(0, batch.owner)[:, None] + torch.arange(inputs.shape[1], device=inputs.device)[None, :]
    attention = torch.cat([batch.prefix_attn.index_select(0, batch.owner), batch.suffix_attn[:, :-1]], dim=1)
    rest = model(input_ids=inputs, attention_mask=attention, position_ids=positions,
                 past_key_values=repeat_cache(out.past_key_values, batch.owner), use_cache=False).logits
    return torch.cat([first, rest], dim=1)
