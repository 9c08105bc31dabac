"""Publishing quantized weights (``weight_sync.publish_quantized``).

The trainer quantizes the weights the generators quantize (``generation.engine.quantize``: every
Linear but the output head and embedding-tied ones, selected by parameter name from the
trainer's model with ``loomrl.models.quantize.quantized_linear_paths``) from its fp32
master weights, with the generators' own per-channel functions, and publishes for each one:

- ``<module>.weight``: the codes (int8, or float8_e4m3fn for ``fp8``) [out, in];
- ``<module>.weight_scale``: the fp32 scales [out] (the name vLLM's quantized checkpoints use).

Every other tensor is published in ``publish_dtype``. Codes and scales are ordinary tensors
of the update (their bytes checksummed in the manifest, XOR-delta'd against the previous
version like any other), so versions, deltas and verification are unchanged; a generator's
mirror holds the codes and scales, and its quantized Linear layers load them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loomrl.weights.params import published_copy

SCALE_SUFFIX = "_scale"  # '<module>.weight' -> '<module>.weight_scale'


def scale_name(weight_name: str) -> str:
    """The name of a quantized weight's scales: 'mlp.up_proj.weight' -> 'mlp.up_proj.weight_scale'."""
    return weight_name + SCALE_SUFFIX


def weight_name(scale: str) -> str | None:
    """The weight a scales tensor belongs to, or None when ``scale`` names no scales."""
    return scale.removesuffix(SCALE_SUFFIX) if scale.endswith(".weight" + SCALE_SUFFIX) else None


def is_codes(t: torch.Tensor) -> bool:
    """Whether ``t`` holds quantized codes (int8 or float8) rather than weights."""
    return t.dtype in (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class QuantizedPublish:
    """Which parameters are published quantized, and to what."""

    kind: str  # 'int8' or 'fp8'
    names: frozenset[str]  # parameter names: '<module path>.weight'

    @classmethod
    def of_model(cls, model: torch.nn.Module, kind: str) -> QuantizedPublish:
        """The weights ``generation.engine.quantize = kind`` quantizes in a generator of ``model``."""
        # lazy: the quantized kernels (and transformers) load only for a quantized generator
        from loomrl.models.quantize import quantized_linear_paths

        if kind not in ("int8", "fp8"):
            raise ValueError(f"publishing quantized weights needs 'int8' or 'fp8', got {kind!r}")
        return cls(
            kind, frozenset(f"{path}.weight" for path in quantized_linear_paths(model, kind))
        )

    def cast(
        self, state: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """``state`` as published: codes and scales for the quantized weights (from the values
        in ``state``, the trainer's masters), every other tensor cast to ``dtype``; on the CPU.
        Reads each tensor of ``state`` once, in order (a sharded trainer's gathers)."""
        # lazy: the quantized kernels (and transformers) load only for a quantized generator
        from loomrl.models.quantize import quantizer

        quantize, out = quantizer(self.kind), {}
        for name, value in state.items():
            if name in self.names:
                codes, scales = quantize(value.detach())
                out[name] = codes.to("cpu").contiguous()
                out[scale_name(name)] = scales.to("cpu").contiguous()
            else:
                out[name] = published_copy(value, dtype)
        missing = self.names.difference(state)
        if missing:
            raise ValueError(
                f"weights selected for quantized publishing are not in the published state: "
                f"{sorted(missing)[:3]}"
            )
        return out
