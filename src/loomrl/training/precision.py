"""The trainer's precision policy (``trainer.precision``) resolved on a device.

- ``fp32``: weights, AdamW state and compute in fp32 (the default on a CPU without native
  bf16; the golden record pins it).
- ``bf16_mixed``: fp32 master weights and AdamW state; forward and backward under bf16
  autocast (the FSDP2 ``MixedPrecisionPolicy`` model). The default on CUDA and on a CPU
  with native bf16 (``loomrl.device.bf16``).
- ``bf16``: weights and AdamW state in bf16.

Under every policy the log-probs, the loss and the importance ratio are fp32: the chunked
log-probs (``loomrl.training.chunked``) project in fp32 outside autocast, and the losses in
``loomrl.algorithms`` get fp32 log-probs.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

from loomrl.device.bf16 import machine_precision
from loomrl.training.config import TrainerConfig

logger = logging.getLogger(__name__)


def resolve_precision(cfg: TrainerConfig, device: torch.device) -> str:
    """``trainer.precision`` on ``device``: 'auto' is bf16_mixed where the device computes
    bf16 natively (CUDA, a CPU with AVX512-BF16, AMX or Arm BF16), fp32 elsewhere."""
    if cfg.precision == "auto":
        return machine_precision(device).precision
    return cfg.precision


def master_dtype(precision: str) -> torch.dtype:
    """The dtype of the trained weights and AdamW state under ``precision``."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the forward computes in under ``precision`` (the KL reference's default)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def autocast(precision: str, device: torch.device):
    """The context the training forward runs in: bf16 autocast for bf16_mixed, else none."""
    if precision == "bf16_mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def chunk_tokens(
    cfg: TrainerConfig, precision: str, device: torch.device, vocab: int | None = None
) -> int | None:
    """Tokens per chunk of the chunked log-probs, or None for the full log-softmax:
    'auto' is on except fp32 training on the CPU of a model whose output ``vocab`` is under
    ``trainer.chunked_logprobs_min_vocab`` (or unknown): bit-identical to the record there."""
    on = cfg.chunked_logprobs
    if on == "auto":
        exact = precision == "fp32" and torch.device(device).type == "cpu"
        on = not exact or (vocab is not None and vocab >= cfg.chunked_logprobs_min_vocab)
    return cfg.logprob_chunk_tokens if on else None


def allow_tf32(cfg: TrainerConfig, device: torch.device) -> None:
    """``trainer.tf32`` on CUDA: TF32 tensor cores for fp32 matmuls (process-wide); the CPU
    is left alone."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """The model's own (Hugging Face) gradient checkpointing, non-reentrant; a clear error
    for a model that has none."""
    if not getattr(model, "supports_gradient_checkpointing", False) or not hasattr(
        model, "gradient_checkpointing_enable"
    ):
        raise ValueError(
            f"trainer.gradient_checkpointing=true, but {type(model).__name__} does not support gradient "
            "checkpointing; set trainer.gradient_checkpointing=false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen eval-mode copy of ``model`` with its parameters in ``dtype``, cast one at a
    time (no full copy in the model's own dtype on the way), e.g. the KL reference."""
    memo = {
        id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo).eval()


def precision_policy(model_cfg, cfg: TrainerConfig, device: torch.device) -> dict[str, str]:
    """What the job computes in on ``device`` and why, for the start line and the run's
    summary: the generators' ``model.dtype`` and the trainer's ``trainer.precision``,
    resolved, with the machine's reason where either is 'auto'."""
    from loomrl.models.loading import resolve_dtype

    auto = [
        key
        for key, value in (("model.dtype", model_cfg.dtype), ("trainer.precision", cfg.precision))
        if value == "auto"
    ]
    reason = f"{' and '.join(auto)} 'auto': {machine_precision(device).reason}" if auto else ""
    return {
        "device": str(device),
        "generator_dtype": str(resolve_dtype(model_cfg, device)).removeprefix("torch."),
        "trainer_precision": resolve_precision(cfg, device),
        "reason": reason or "model.dtype and trainer.precision set in the config",
    }


def describe_policy(policy: dict[str, str]) -> str:
    """The start line of ``precision_policy``."""
    return (
        f"precision: generators compute in {policy['generator_dtype']}, the trainer in "
        f"{policy['trainer_precision']} on {policy['device']} ({policy['reason']})"
    )
