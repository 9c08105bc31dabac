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
from loomrl.training.chunked import final_hidden
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
    same_version: torch.Tensor  # [rows] or [rows, S] bool: sampled at the trainer's version

    def to(self, device: torch.device) -> PrefixBatch:
        return PrefixBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def num_prompts(self) -> int:
        return self.prefix_ids.shape[0]


def padded_tensor(rows: list[list], width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` right-padded with ``fill`` to ``width``, as one tensor: one ``torch.tensor``
    call for the batch, not a slice assignment per row."""
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=dtype)


def same_version_mask(
    rollouts: list[Rollout], version: int, width: int, lead: list[int] | None = None
) -> torch.Tensor:
    """Which behaviour log-probs the trainer's own ``version`` sampled (the training-
    inference parity metrics read those): ``[rows]`` bool, a rollout's tokens all at its
    version; where some rollout's weights changed while it was generated (in-flight
    updates: ``token_versions``), ``[rows, width]`` per token, aligned as the behaviour
    log-probs are (``lead[i]`` positions before row ``i``'s completion)."""
    if all(r.token_versions is None for r in rollouts):
        return torch.tensor([r.version == version for r in rollouts])
    rows = []
    for i, r in enumerate(rollouts):
        per_token = r.token_versions or [r.version] * len(r.completion_ids)
        rows.append([False] * (lead[i] if lead else 0) + [v == version for v in per_token])
    return padded_tensor(rows, width, False, torch.bool)


def build_prefix_batch(
    rollouts: list[Rollout], advantages: list[float], version: int, pad_id: int
) -> PrefixBatch:
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(r.prompt_ids), len(index)) for r in rollouts]
    prompts = [list(p) for p in index]
    width = max(map(len, prompts))
    completions = [r.completion_ids for r in rollouts]
    s = max(max(map(len, completions)), 1)
    prefix_attn = padded_tensor([[1] * len(p) for p in prompts], width, 0, torch.long)
    return PrefixBatch(
        padded_tensor(prompts, width, pad_id, torch.long),
        prefix_attn,
        prefix_attn.sum(1),
        torch.tensor(owner),
        padded_tensor(completions, s, pad_id, torch.long),
        padded_tensor([[1] * len(c) for c in completions], s, 0, torch.long),
        padded_tensor([r.loss_mask for r in rollouts], s, 0.0, torch.float32),
        padded_tensor([r.behaviour_logprobs for r in rollouts], s, 0.0, torch.float32),
        torch.tensor(advantages, dtype=torch.float32),
        same_version_mask(rollouts, version, s),
    )


def prefix_logits(
    model: torch.nn.Module, batch: PrefixBatch, *, hidden: bool = False
) -> torch.Tensor:
    """Logits ``[rows, S, vocab]``: position ``j`` predicts completion token ``j``.
    ``hidden=True``: the final hidden states ``[rows, S, H]`` that those logits project
    (the decoder without its output projection, for ``loomrl.training.chunked``)."""
    if hidden:

        def run(**inputs):
            out = final_hidden(model, **inputs)
            return out.last_hidden_state, out.past_key_values
    else:

        def run(**inputs):
            out = model(**inputs)
            return out.logits, out.past_key_values

    states, cache = run(
        input_ids=batch.prefix_ids, attention_mask=batch.prefix_attn, use_cache=True
    )
    # predicts the first token
    last = states[torch.arange(batch.num_prompts, device=batch.owner.device), batch.prefix_len - 1]
    first = last.index_select(0, batch.owner).unsqueeze(1)
    if batch.suffix_ids.shape[1] == 1:
        return first
    inputs = batch.suffix_ids[:, :-1]
    positions = (
        batch.prefix_len.index_select(0, batch.owner)[:, None]
        + torch.arange(inputs.shape[1], device=inputs.device)[None, :]
    )
    attention = torch.cat(
        [batch.prefix_attn.index_select(0, batch.owner), batch.suffix_attn[:, :-1]], dim=1
    )
    rest, _ = run(
        input_ids=inputs,
        attention_mask=attention,
        position_ids=positions,
        past_key_values=repeat_cache(cache, batch.owner),
        use_cache=False,
    )
    return torch.cat([first, rest], dim=1)
