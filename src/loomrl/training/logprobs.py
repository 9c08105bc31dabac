"""The trainer's forward: a micro-batch (padded ``TokenBatch``, shared-prompt ``PrefixBatch``
or packed ``PackedBatch``) to the fp32 log-probs and entropies of its next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomrl.training.chunked import chunked_logprobs, final_hidden, output_weight
from loomrl.training.packing import PackedBatch, packed_inputs
from loomrl.training.prefix import PrefixBatch, padded_tensor, prefix_logits, same_version_mask
from loomrl.types import Rollout


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [batch, seq] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [batch, seq]
    target_mask: torch.Tensor  # [batch, seq-1] 1 where the next token is a trained completion token
    behaviour: torch.Tensor  # [batch, seq-1] behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [batch]
    same_version: torch.Tensor  # [batch] or [batch, seq-1] bool: sampled at the trainer's version

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.target_mask,
                    self.behaviour,
                    self.advantages,
                    self.same_version,
                )
            )
        )


def build_token_batch(
    rollouts: list[Rollout], advantages: list[float], version: int, pad_id: int
) -> TokenBatch:
    ids = [r.prompt_ids + r.completion_ids for r in rollouts]
    width = max(map(len, ids))
    # Logits at position p predict token p + 1: a completion's targets start one before it.
    shift = [[0.0] * (len(r.prompt_ids) - 1) for r in rollouts]
    return TokenBatch(
        padded_tensor(ids, width, pad_id, torch.long),
        padded_tensor([[1] * len(row) for row in ids], width, 0, torch.long),
        padded_tensor(
            [a + r.loss_mask for a, r in zip(shift, rollouts)], width - 1, 0.0, torch.float32
        ),
        padded_tensor(
            [a + r.behaviour_logprobs for a, r in zip(shift, rollouts)],
            width - 1,
            0.0,
            torch.float32,
        ),
        torch.tensor(advantages, dtype=torch.float32),
        same_version_mask(rollouts, version, width - 1, list(map(len, shift))),
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch | PrefixBatch | PackedBatch,
    temperature: float,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token and the entropy of each prediction, in fp32, aligned
    with ``batch.target_mask``: ``[batch, seq-1]`` for a ``TokenBatch`` and a
    ``PackedBatch`` (zeros on padding), ``[batch, completion]`` for a ``PrefixBatch`` (each
    prompt computed once). ``chunk``: from the final hidden states ``chunk`` tokens at a
    time (``loomrl.training.chunked``), where the model's output projection is a plain
    ``Linear``; None: the full log-softmax."""
    weight = output_weight(model) if chunk is not None else None
    if isinstance(batch, PackedBatch):
        return _packed_logprobs(model, batch, temperature, chunk, weight)
    if weight is not None:
        if isinstance(batch, PrefixBatch):
            hidden, targets = prefix_logits(model, batch, hidden=True), batch.suffix_ids
        else:
            out = final_hidden(
                model,
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                use_cache=False,
            )
            hidden, targets = out.last_hidden_state[:, :-1], batch.input_ids[:, 1:]
        return chunked_logprobs(hidden, weight, targets, temperature, chunk)
    if isinstance(batch, PrefixBatch):
        logits = prefix_logits(model, batch).float() / temperature
        targets = batch.suffix_ids
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1, :].float() / temperature
        targets = batch.input_ids[:, 1:]
    return _full_logprobs(logits, targets)


def _full_logprobs(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from fp32 ``logits`` (already tempered)."""
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    chunk: int | None,
    weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of a packed row: one forward, then only the positions that
    predict a token of their own rollout, back in the padded layout."""
    inputs = packed_inputs(model, batch)
    targets = batch.input_ids[0].index_select(0, batch.source + 1)
    if weight is not None:
        hidden = final_hidden(model, **inputs).last_hidden_state[0].index_select(0, batch.source)
        logp, entropy = chunked_logprobs(hidden, weight, targets, temperature, chunk)
    else:
        logits = model(**inputs).logits[0].index_select(0, batch.source)
        logp, entropy = _full_logprobs(logits.float() / temperature, targets)
    return batch.unpack(logp), batch.unpack(entropy)


class Logprobs(torch.nn.Module):
    """``token_logprobs`` over a batch's tensors (a ``PrefixBatch``'s six inputs, or a
    ``TokenBatch``'s ids and mask), so that it can run from traces."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(tensors) == 2:
            batch = TokenBatch(tensors[0], tensors[1], *([None] * 4))
        else:
            batch = PrefixBatch(*tensors, *([None] * 4))
        return token_logprobs(self.model, batch, self.temperature)

    @staticmethod
    def inputs(batch: TokenBatch | PrefixBatch) -> tuple[torch.Tensor, ...]:
        if isinstance(batch, PrefixBatch):
            return (
                batch.prefix_ids,
                batch.prefix_attn,
                batch.prefix_len,
                batch.owner,
                batch.suffix_ids,
                batch.suffix_attn,
            )
        return batch.input_ids, batch.attention_mask
