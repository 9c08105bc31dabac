"""Weight quantization of a generator's Linear layers (``generation.engine.quantize``).

What: every ``nn.Linear`` of the model but the output head (and any Linear whose weight is
tied to an embedding) is replaced by a module that holds its weight quantized per output
channel (one scale a row: ``scale = max|w_row| / qmax``). Embeddings, norms and the output
head stay in full precision.

Where: on the generator, after weight sync. The receiver keeps the unquantized mirror (the
published weights deltas apply to); each update hands the engine the tensors it changed, and
``QuantizedLinears.load`` re-quantizes exactly those, writing in place (the buffers a CUDA
graph reads keep their addresses).

Kernels (docs/engines.md, "Quantized generation"):
- ``int8`` on the CPU: torch's dynamic int8 Linear (``torch.ao.nn.quantized.dynamic``, fbgemm
  or onednn): int8 weights packed once per update, activations quantized per call, int8 x int8
  matmuls: the fastest CPU kernel measured, ahead of the fp32 Linear, torchao's dynamic
  int8 config and ``torch._weight_int8pack_mm`` (weight-only); docs/engines.md has the times.
- ``int8`` on CUDA: weight-only int8 (halves the weight memory of a bf16 model); the forward
  dequantizes the rows it multiplies, so it is not faster than bf16.
- ``fp8`` (CUDA only): e4m3 weights with per-row scales and per-token activation scales,
  multiplied by ``torch._scaled_mm`` (rowwise scaling: sm89/sm90 and later).
- ``int4`` (CPU only): group-wise weight-only int4, ``loomrl.models.quantize_int4``.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from loomrl.models.quantize_int4 import CpuInt4Linear, fits_int4

logger = logging.getLogger(__name__)

QuantizeKind = Literal["none", "int8", "fp8", "int4"]
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_ALIGN = 16  # torch._scaled_mm needs both weight dimensions divisible by this


def per_channel_scales(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    """[out] fp32 scales: each output row's absolute maximum over ``qmax`` (1 for an all-zero row)."""
    amax = weight.detach().float().abs().amax(dim=1)
    # a true division on every device: CUDA computes `tensor / python_float` as a multiply by
    # the reciprocal (BinaryDivTrueKernel.cu), one ulp off the CPU's for some rows, and a
    # trainer publishing codes from host copies (offloaded) and from the device must agree
    divisor = torch.full((), qmax, dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp32 scales [out]): round-to-nearest per output channel, symmetric."""
    scales = per_channel_scales(weight, INT8_MAX)
    q = (weight.detach().float() / scales[:, None]).round().clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], fp32 scales [out]) per output channel."""
    scales = per_channel_scales(weight, FP8_MAX)
    q = (weight.detach().float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scales


class CpuInt8Linear(torch.nn.Module):
    """A Linear computed by torch's dynamic int8 kernel (CPU): per-channel int8 weights,
    activations quantized per call; input and output in the caller's dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()

        self.inner = DynamicLinear(
            linear.in_features, linear.out_features, bias_=linear.bias is not None
        )
        self.inner.qconfig = None
        self._bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.load_weight(linear.weight)

    def load_weight(self, weight: torch.Tensor) -> None:
        q, scales = quantize_int8(weight)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zero, 0)
        self.inner.set_weight_bias(qweight, self._bias)

    def load_quantized(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Take int8 codes [out, in] and fp32 scales [out] as they are (published quantized)."""
        zero = torch.zeros(codes.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero, 0)
        self.inner.set_weight_bias(qweight, self._bias)

    def load_bias(self, bias: torch.Tensor) -> None:
        self._bias = bias.detach().float().clone()
        self.inner.set_weight_bias(self.inner.weight(), self._bias)

    def weight_bytes(self) -> int:
        out_features, in_features = self.inner.weight().shape
        bias = 0 if self._bias is None else self._bias.numel() * 4
        return out_features * in_features + out_features * 8 + bias  # int8 + fp64 scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float()).to(x.dtype)


class DeviceQuantLinear(torch.nn.Module):
    """A Linear on a CUDA device with quantized weight buffers, written in place on update:
    ``fp8`` through ``torch._scaled_mm`` (per-token activation scales), ``int8`` weight-only."""

    def __init__(self, linear: torch.nn.Linear, kind: str) -> None:
        super().__init__()
        self.kind = kind
        q, scales = quantizer(kind)(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.view(1, -1).contiguous())  # [1, out]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def load_weight(self, weight: torch.Tensor) -> None:
        q, scales = quantizer(self.kind)(weight.to(self.qweight.device))
        self.qweight.copy_(q)
        self.scales.copy_(scales.view(1, -1))

    def load_quantized(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Take codes [out, in] (int8 or e4m3) and fp32 scales [out] as they are, in place."""
        if codes.dtype != self.qweight.dtype:  # copy_ would convert the values silently
            raise ValueError(f"{codes.dtype} codes for a {self.qweight.dtype} ({self.kind}) layer")
        self.qweight.copy_(codes)
        self.scales.copy_(scales.view(1, -1))

    def load_bias(self, bias: torch.Tensor) -> None:
        self.bias.copy_(bias)

    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4 + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if self.kind == "int8":
            weight = self.qweight.to(x.dtype) * self.scales.t().to(x.dtype)
            out = torch.nn.functional.linear(rows, weight, self.bias)
        else:
            x_scales = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            x_q = (rows.float() / x_scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            # rowwise scales: fp32 [rows, 1] and [1, out]; bf16 out (what rowwise scaling takes)
            out = torch._scaled_mm(
                x_q,
                self.qweight.t(),  # [in, out], column-major as _scaled_mm wants
                scale_a=x_scales,
                scale_b=self.scales,
                out_dtype=torch.bfloat16,
            ).to(x.dtype)
            out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


class QuantizedLinears:
    """The quantized Linear modules of one model, by the parameter names weight sync uses."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.modules = modules  # Linear's module path -> quantized module

    def owns(self, name: str) -> bool:
        """Whether the parameter ``name`` ('layers.0.mlp.up_proj.weight') is quantized."""
        module, _, leaf = name.rpartition(".")
        return module in self.modules and leaf in ("weight", "bias")

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Re-quantize one parameter from its unquantized value (the receiver's mirror)."""
        module, _, leaf = name.rpartition(".")
        target = self.modules[module]
        with torch.no_grad():
            target.load_weight(tensor) if leaf == "weight" else target.load_bias(tensor)

    def load_quantized(self, module: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Load one Linear's published codes and scales without re-quantizing."""
        with torch.no_grad():
            self.modules[module].load_quantized(codes, scales)

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes() for m in self.modules.values())


def check_quantize(kind: str, device: torch.device) -> None:
    """A clear error for a precision the device cannot run."""
    if kind not in ("none", "int8", "fp8", "int4"):
        raise ValueError(
            f"generation.engine.quantize must be 'none', 'int8', 'fp8' or 'int4', got {kind!r}"
        )
    if kind == "int4" and device.type != "cpu":
        raise ValueError(
            f"generation.engine.quantize='int4' runs on the CPU only (torch's int4 weight-only CPU "
            f"kernel); the generator's model is on {device.type!r}: use 'fp8' or 'int8' there"
        )
    if kind == "fp8" and device.type != "cuda":
        raise ValueError(
            f"generation.engine.quantize='fp8' needs a CUDA device (fp8 matmuls through torch._scaled_mm); "
            f"the generator's model is on {device.type!r}: use 'int8' there, or 'none'"
        )
    if kind == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"generation.engine.quantize='fp8' needs compute capability 8.9 or later (torch._scaled_mm's "
            f"rowwise fp8), got {torch.cuda.get_device_capability(device)}: use 'int8' or 'none'"
        )


def _skipped(model: torch.nn.Module) -> set[int]:
    """ids of the Linear modules left in full precision: the output head, and any Linear
    whose weight is an embedding's (tied)."""
    skip = set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip.add(id(head))
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) in embedding_weights:
            skip.add(id(m))
    return skip


def _quantized_module(linear: torch.nn.Linear, kind: str, device: torch.device) -> torch.nn.Module:
    if kind == "int4":
        return CpuInt4Linear(linear)
    return CpuInt8Linear(linear) if device.type == "cpu" else DeviceQuantLinear(linear, kind)


def _kept_unquantized(linear: torch.nn.Linear, kind: str) -> str | None:
    """Why ``kind``'s kernel cannot take this Linear, or None when it can."""
    if kind == "fp8" and (linear.in_features % FP8_ALIGN or linear.out_features % FP8_ALIGN):
        return "fp8 needs dimensions divisible by 16"
    if kind == "int4" and not fits_int4(linear):
        return "int4 needs whole groups of inputs"
    return None


def quantized_linear_paths(model: torch.nn.Module, kind: str) -> list[str]:
    """The module paths of the Linear layers ``generation.engine.quantize = kind`` quantizes: all
    but the output head, embedding-tied ones and those the kernel cannot take. The one
    selection rule: ``quantize_linears`` replaces these, and a trainer that publishes
    quantized weights selects them with it."""
    skip, paths = _skipped(model), []
    for path, linear in model.named_modules():
        if not isinstance(linear, torch.nn.Linear) or id(linear) in skip:
            continue
        reason = _kept_unquantized(linear, kind)
        if reason is not None:
            logger.info("%s stays unquantized: %s", path, reason)
            continue
        paths.append(path)
    return paths


def quantize_linears(model: torch.nn.Module, kind: str) -> QuantizedLinears:
    """Replace the model's Linear layers (``quantized_linear_paths``) by quantized ones, in
    place, from their current weights."""
    device = next(model.parameters()).device
    check_quantize(kind, device)
    replaced = {}
    for path in quantized_linear_paths(model, kind):
        quantized = _quantized_module(model.get_submodule(path), kind, device)
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path), child, quantized)
        replaced[path] = quantized
    logger.info("generator quantized %d Linear layers to %s", len(replaced), kind)
    return QuantizedLinears(replaced)


def quantizer(kind: str):
    """The function that quantizes one weight for ``kind``: ``quantize_int8`` or ``quantize_fp8``."""
    return quantize_fp8 if kind == "fp8" else quantize_int8
