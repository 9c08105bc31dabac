"""Packed micro-batches (``trainer.packing``): a micro-batch's sequences end to end in one
row, no padding.

A padded micro-batch computes every row to its longest one's length; with lengths spread
16-512 about half of that is padding. Packed, the rows run as one ``[1, tokens]`` sequence
whose position ids restart at 0 for each rollout, and attention stays within each rollout:

- SDPA and eager attention (the CPU, and a GPU without flash-attention) get a 4-D
  block-diagonal causal mask ``[1, 1, tokens, tokens]`` (booleans for SDPA, additive for
  eager). transformers would build the same one from the position ids alone (its
  ``find_packed_sequence_indices``), but only with no attention mask and no cache object;
  the mask given here does not depend on that. Attention then computes the whole
  ``tokens x tokens`` block under the mask, so ``trainer.packing_max_tokens`` bounds it.
- flash-attention (``flash_attention_2``/``_3``) gets no mask: it reads the sequence
  boundaries from the position ids (its varlen kernel), and computes no masked-out block.

Log-probs come back in the padded layout ``[rows, width - 1]`` of ``TokenBatch`` (zeros
where a row is padding), so the losses, their statistics and the KL penalty are the padded
path's; only the forward changes. Each rollout's last position predicts the next rollout's
first token: it is never read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loomrl.types import Rollout

# the attention implementations a packed row runs under, and how each is told the boundaries
MASKED = {"sdpa": "bool", "eager": "additive"}
VARLEN = ("flash_attention_2", "flash_attention_3")


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, tokens] the rollouts' prompt + completion, end to end
    position_ids: torch.Tensor  # [1, tokens] 0, 1, ... within each rollout
    doc: torch.Tensor  # [tokens] the rollout each token belongs to
    source: torch.Tensor  # [n] packed positions that predict a token of their own rollout
    dest: torch.Tensor  # [n] where each goes in the flattened [rows, width - 1] layout
    target_mask: torch.Tensor  # [rows, width-1] as TokenBatch's
    behaviour: torch.Tensor  # [rows, width-1]
    advantages: torch.Tensor  # [rows]
    same_version: torch.Tensor  # [rows] or [rows, seq-1] bool: sampled at the trainer's version

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [n]`` (one per ``source``) in the padded ``[rows, width - 1]`` layout,
        zeros where a row has no token; differentiable."""
        flat = values.new_zeros(self.target_mask.numel())
        return flat.index_put((self.dest,), values).view(self.target_mask.shape)


def pack_slices(rollouts: list[Rollout], max_rows: int, max_tokens: int) -> list[slice]:
    """Consecutive micro-batches of at most ``max_rows`` rollouts and ``max_tokens`` tokens
    end to end (prompt + completion, unpadded); a rollout longer than ``max_tokens`` is a
    micro-batch of its own."""
    slices, start, used = [], 0, 0
    for i, r in enumerate(rollouts):
        length = len(r.prompt_ids) + len(r.completion_ids)
        if i > start and (i - start >= max_rows or used + length > max_tokens):
            slices.append(slice(start, i))
            start, used = i, 0
        used += length
    slices.append(slice(start, len(rollouts)))
    return slices


def build_packed_batch(rollouts: list[Rollout], padded) -> PackedBatch:
    """The packed form of ``rollouts``; ``padded``: their ``TokenBatch`` (its targets,
    behaviour log-probs, advantages and versions are kept as they are)."""
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    width = padded.input_ids.shape[1] - 1
    ids, positions, doc, source, dest, offset = [], [], [], [], [], 0
    for row, (r, n) in enumerate(zip(rollouts, lengths)):
        ids += r.prompt_ids + r.completion_ids
        positions += range(n)
        doc += [row] * n
        source += range(offset, offset + n - 1)
        dest += range(row * width, row * width + n - 1)
        offset += n
    return PackedBatch(
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([positions], dtype=torch.long),
        torch.tensor(doc, dtype=torch.long),
        torch.tensor(source, dtype=torch.long),
        torch.tensor(dest, dtype=torch.long),
        padded.target_mask,
        padded.behaviour,
        padded.advantages,
        padded.same_version,
    )


def check_packable(model: torch.nn.Module) -> None:
    """A clear error where a packed row would not keep attention within each rollout:
    an attention implementation without a mask or varlen path here, or layers that are
    not full attention (a sliding window would need its own banded mask)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED and impl not in VARLEN:
        raise ValueError(
            f"trainer.packing=true: attention implementation {impl!r} has no packed path here "
            f"(supported: {sorted(MASKED) + list(VARLEN)}); set trainer.packing=false"
        )
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:  # no per-layer list (Mistral, Mixtral, Phi-3, Starcoder2): a set
        # sliding_window applies to every layer
        window = getattr(config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if window else "full_attention"]
    if impl in MASKED and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"trainer.packing=true: layer types {sorted(set(layer_types))} under {impl!r} "
            "(the packed mask is full causal attention within each rollout); set "
            "trainer.packing=false"
        )


def packed_inputs(model: torch.nn.Module, batch: PackedBatch) -> dict:
    """The forward's keyword arguments for ``batch``: ids, restarting position ids, and
    the block-diagonal causal mask its attention implementation reads (none for varlen)."""
    impl = model.config._attn_implementation
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    if impl in VARLEN:
        inputs["attention_mask"] = None
        return inputs
    n = batch.doc.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=batch.doc.device).tril_()
    allowed = (batch.doc[:, None] == batch.doc[None, :]).logical_and_(causal)[None, None]
    if MASKED.get(impl) == "bool":
        inputs["attention_mask"] = allowed
    else:
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        inputs["attention_mask"] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return inputs
