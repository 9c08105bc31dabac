"""LoRA jobs sync only the adapter: extract it from a PEFT model and load it into another.

The trainer publishes ``adapter_state(model)`` (a few MB) instead of the whole model; the
generator, which holds the same frozen base weights, mirrors the adapter and loads it with
``load_adapter_state``. Names are PEFT's adapter-agnostic keys, so trainer and generator
may use different adapter names.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries PEFT adapters."""
    return hasattr(model, "peft_config")


def adapter_state(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights (and PEFT's ``modules_to_save``), detached, sharing storage with
    the model; what a LoRA trainer publishes."""
    # lazy: peft is optional (the lora extra)
    from peft import get_peft_model_state_dict

    if not is_peft_model(model):
        raise ValueError("adapter_state needs a PEFT model (peft.get_peft_model(...))")
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {name: t.detach() for name, t in state.items()}


def load_adapter_state(
    model: torch.nn.Module, state: dict[str, torch.Tensor], adapter_name: str = "default"
) -> None:
    """Load an adapter state (any float dtype; cast to the model's) into a PEFT model."""
    # lazy: peft is optional (the lora extra)
    from peft import set_peft_model_state_dict

    if not is_peft_model(model):
        raise ValueError("load_adapter_state needs a PEFT model (peft.get_peft_model(...))")
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"adapter state has keys the model does not: {unexpected[:5]}")
