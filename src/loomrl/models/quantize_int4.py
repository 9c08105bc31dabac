"""int4 weight-only quantization of a generator's Linear layers (``generation.engine.quantize="int4"``).

Group-wise and asymmetric, as GPTQ/AWQ-style int4 generation is: along each output row the
input dimension is cut into groups of ``INT4_GROUP`` values; each group gets a scale
``(max - min) / 15`` and a zero point, and every weight a 4-bit code ``q`` in 0..15, so that
``w ~= (q - 8) * scale + zero``. Activations stay in full precision. The group is 128 inputs
(GPTQ's and AWQ's usual size), or 64 or 32 where the input dimension is not a multiple of 128;
a Linear whose input dimension is not a multiple of 32 stays unquantized.

Kernel: torch's own CPU int4 matmul (``aten._weight_int4pack_mm_for_cpu``, the one torchao's
int4 weight-only CPU layout calls), weights packed two codes a byte once per update by
``aten._convert_weight_to_int4pack_for_cpu``, with bf16 activations, scales and zeros (its
fp32 path is far slower). The kernel is built for a few rows: it is as fast as the fp32
Linear at 16 rows and slower at 64, so int4 here saves memory first (a quarter of the weight
bytes), and time only at few rows a step (docs/engines.md, "Quantized generation", has the
times; ``bench/quantized.py`` measures them). CPU only: on CUDA use ``fp8`` or ``int8``.

Why it is here: on a small model int8 moves the behaviour log-probs by ~0.02 nats a token, too
little for the loss's importance correction to matter; int4 is the precision at which the
generator's policy differs from the trainer's by an amount a correction has to handle, which
is what ``bench/quantized_learning.py`` shows with precision as its axis.
"""

from __future__ import annotations

import torch

INT4_GROUPS = (128, 64, 32)  # input values sharing one scale and zero point, first that divides
INT4_LEVELS = 15.0  # codes 0..15
INNER_K_TILES = 2  # the packing's inner tile count (the kernel takes 2, 4 or 8)


def int4_group(in_features: int) -> int | None:
    """The group size for a Linear with ``in_features`` inputs, None where none fits."""
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def fits_int4(linear: torch.nn.Linear) -> bool:
    """Whether the kernel takes this Linear: whole groups along the input dimension."""
    return int4_group(linear.in_features) is not None


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 codes 0..15 [out, in], scales and zeros [in / group, out, 2], bf16 values held
    in fp32): round to nearest within each group's [min, max] range, the kernel's layout."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(-1, group)
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    # the kernel's fast path reads bf16 scales and zeros: round them first, codes from those
    scales = ((high - low) / INT4_LEVELS).clamp(min=1e-6).bfloat16().float()
    zeros = (low + scales * 8).bfloat16().float()
    codes = ((groups - (zeros - scales * 8)) / scales).round().clamp(0, INT4_LEVELS).to(torch.int32)
    scales_and_zeros = torch.cat(
        [scales.reshape(out_features, -1, 1), zeros.reshape(out_features, -1, 1)], dim=2
    )
    return codes.reshape(out_features, in_features), scales_and_zeros.transpose(0, 1).contiguous()


def dequantize_int4(
    codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The fp32 weight [out, in] the codes stand for (the reference the kernel computes with)."""
    out_features, in_features = codes.shape
    sz = scales_and_zeros.transpose(0, 1).reshape(-1, 2)  # [out * groups, 2]
    groups = codes.reshape(-1, group).float()
    return ((groups - 8) * sz[:, :1] + sz[:, 1:]).reshape(out_features, in_features)


class CpuInt4Linear(torch.nn.Module):
    """A Linear computed by torch's int4 weight-only CPU kernel: packed 4-bit codes with a
    scale and zero point per group of inputs; input and output in the caller's dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        group = int4_group(linear.in_features)
        if group is None:
            raise ValueError(
                f"int4 needs in_features divisible by {INT4_GROUPS[-1]}, got {linear.in_features}"
            )
        self.group, self.out_features = group, linear.out_features
        self._bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.load_weight(linear.weight)

    def load_weight(self, weight: torch.Tensor) -> None:
        codes, scales_and_zeros = quantize_int4(weight, self.group)
        self.scales_and_zeros = scales_and_zeros.bfloat16()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)

    def load_bias(self, bias: torch.Tensor) -> None:
        self._bias = bias.detach().float().clone()

    def weight_bytes(self) -> int:
        bias = 0 if self._bias is None else self._bias.numel() * 4
        return self.packed.numel() + self.scales_and_zeros.numel() * 2 + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).bfloat16().contiguous()  # the kernel's fast path
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group, self.scales_and_zeros
        )
        out = out.float() if self._bias is None else out.float() + self._bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
