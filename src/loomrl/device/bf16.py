"""Whether a device computes bf16 natively, and so what the 'auto' precisions mean on it.

``model.dtype='auto'`` and ``trainer.precision='auto'`` follow the machine: where bf16
matmuls are native (CUDA; a CPU with AVX512-BF16 or AMX-BF16 on x86, the BF16 extension on
Arm) the generators compute in bf16 and the trainer trains under bf16 autocast with fp32
master weights and fp32 log-probs, loss and ratios; elsewhere both stay fp32.

The CPU's flags come from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``). The
environment variable ``LOOMRL_CPU_FLAGS`` replaces them when set (a space- or
comma-separated list; empty: a CPU with no bf16): to see what 'auto' picks on another CPU,
and so that the test suite does not depend on the CPU it runs on.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
FLAGS_ENV = "LOOMRL_CPU_FLAGS"
# x86: AVX512-BF16 (vdpbf16ps; Cooper Lake, Zen 4 on) and AMX-BF16 (Sapphire Rapids on).
# Arm: the BF16 extension (BFDOT, BFMMLA; Armv8.6, Neoverse V1/N2 on).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@dataclass(frozen=True)
class MachinePrecision:
    """What the 'auto' precisions resolve to on one device, and why."""

    bf16: bool
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        """``model.dtype='auto'``: the generators' compute dtype (and the KL reference's)."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def precision(self) -> str:
        """``trainer.precision='auto'``."""
        return "bf16_mixed" if self.bf16 else "fp32"


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in ``/proc/cpuinfo`` text (x86's ``flags`` line,
    Arm's ``Features`` line); empty where there is neither."""
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def cpu_flags() -> tuple[frozenset[str], str]:
    """This CPU's feature flags and where they came from (``LOOMRL_CPU_FLAGS`` when set,
    else ``/proc/cpuinfo``; none where that cannot be read)."""
    if FLAGS_ENV in os.environ:
        return frozenset(os.environ[FLAGS_ENV].replace(",", " ").split()), f"${FLAGS_ENV}"
    return _proc_cpu_flags()


@functools.lru_cache(maxsize=1)
def _proc_cpu_flags() -> tuple[frozenset[str], str]:
    try:
        return parse_cpu_flags(CPUINFO.read_text()), str(CPUINFO)
    except OSError:
        return frozenset(), f"no readable {CPUINFO}"


def cpu_precision(flags: frozenset[str], source: str = "the CPU flags") -> MachinePrecision:
    """The 'auto' precision of a CPU with ``flags``."""
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return MachinePrecision(True, f"this CPU has native bf16 ({', '.join(found)}; {source})")
    return MachinePrecision(
        False, f"this CPU has no native bf16 (no {'/'.join(NATIVE_BF16_FLAGS)} in {source})"
    )


def machine_precision(device: torch.device | str) -> MachinePrecision:
    """What 'auto' precision means on ``device``: bf16 on CUDA and on a CPU with native bf16,
    fp32 elsewhere."""
    kind = torch.device(device).type
    if kind == "cuda":
        return MachinePrecision(True, "CUDA device (bf16 tensor cores)")
    if kind != "cpu":
        return MachinePrecision(False, f"{kind} device: fp32 unless asked")
    return cpu_precision(*cpu_flags())
