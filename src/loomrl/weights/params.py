"""Which of a model's tensors weight sync carries. Trainer and generators meet only here:
the trainer publishes ``synced_params`` of its model, a generator mirrors the same names."""

from __future__ import annotations

import torch

from loomrl.weights.lora import adapter_state, is_peft_model


def synced_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors weight sync carries, detached and sharing storage with the model: every
    parameter (tied weights once), or for a PEFT model only the adapter, all that changes."""
    if is_peft_model(model):
        return adapter_state(model)
    return {name: p.detach() for name, p in model.named_parameters()}


def published_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the publisher sends of one tensor: a contiguous host copy in the published dtype."""
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()


def published_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of ``synced_params`` in the published dtype."""
    return {name: t.to(dtype).clone() for name, t in synced_params(model).items()}
