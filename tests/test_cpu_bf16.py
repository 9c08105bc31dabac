"""The 'auto' precisions follow the machine (``loomrl.device.bf16``): bf16 where the CPU has
native bf16, fp32 where it has none. Every test here mocks the CPU's flags; none depends on
the CPU it runs on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from loomrl.config import ModelConfig, TrainerConfig, build_config
from loomrl.device import bf16
from loomrl.job import Job
from loomrl.models.loading import resolve_dtype
from loomrl.training.precision import chunk_tokens, precision_policy, resolve_precision

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
bogomips\t: 4000.00

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid bf16 i8mm
CPU implementer\t: 0x41
"""
CPU = torch.device("cpu")


def test_cpuinfo_flags_are_read_from_x86_flags_and_arm_features():
    assert {"avx512_bf16", "amx_bf16", "avx2"} <= bf16.parse_cpu_flags(X86_CPUINFO)
    assert {"bf16", "i8mm", "asimd"} <= bf16.parse_cpu_flags(ARM_CPUINFO)
    assert bf16.parse_cpu_flags("processor\t: 0\n") == frozenset()


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("avx2 avx512f avx512_bf16", "avx512_bf16"),
        ("avx2 amx_tile amx_bf16", "amx_bf16"),
        ("fp asimd bf16 i8mm", "bf16"),
        # AVX-512 without its BF16 extension, AVX2 only, an Arm core before Armv8.6
        ("avx2 avx512f avx512bw avx512_vnni", None),
        ("sse2 avx avx2 fma", None),
        ("fp asimd asimddp", None),
        ("", None),
    ],
)
def test_detection_picks_each_policy_from_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setenv(bf16.FLAGS_ENV, flags)
    machine = bf16.machine_precision("cpu")
    if native is None:
        assert (machine.bf16, machine.dtype, machine.precision) == (False, torch.float32, "fp32")
        assert "no native bf16" in machine.reason
    else:
        assert (machine.bf16, machine.dtype) == (True, torch.bfloat16)
        assert machine.precision == "bf16_mixed"
        assert native in machine.reason
    # the two 'auto' keys follow it; a pinned one does not
    assert resolve_dtype(ModelConfig(), CPU) == machine.dtype
    assert resolve_precision(TrainerConfig(), CPU) == machine.precision
    assert resolve_dtype(ModelConfig(dtype="float32"), CPU) == torch.float32
    assert resolve_precision(TrainerConfig(precision="fp32"), CPU) == "fp32"


def test_detection_reads_proc_cpuinfo_when_no_flags_are_given(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(bf16.FLAGS_ENV)
    for text, want in ((X86_CPUINFO, True), (ARM_CPUINFO, True), ("flags : sse2 avx2\n", False)):
        (tmp_path / "cpuinfo").write_text(text)
        monkeypatch.setattr(bf16, "CPUINFO", tmp_path / "cpuinfo")
        bf16._proc_cpu_flags.cache_clear()
        assert bf16.machine_precision("cpu").bf16 is want
    monkeypatch.setattr(bf16, "CPUINFO", tmp_path / "missing")
    bf16._proc_cpu_flags.cache_clear()
    machine = bf16.machine_precision("cpu")
    assert not machine.bf16 and "no readable" in machine.reason
    bf16._proc_cpu_flags.cache_clear()


def test_cuda_is_bf16_whatever_the_cpu(monkeypatch):
    monkeypatch.setenv(bf16.FLAGS_ENV, "")
    assert bf16.machine_precision("cuda").precision == "bf16_mixed"
    assert resolve_dtype(ModelConfig(), torch.device("cuda")) == torch.bfloat16


def test_bf16_training_on_the_cpu_keeps_fp32_log_probs_in_chunks(monkeypatch):
    """Under bf16 autocast the log-probs are chunked, projected in fp32 outside autocast."""
    monkeypatch.setenv(bf16.FLAGS_ENV, "avx512_bf16")
    precision = resolve_precision(TrainerConfig(), CPU)
    assert chunk_tokens(TrainerConfig(), precision, CPU) == TrainerConfig().logprob_chunk_tokens


def test_the_golden_record_pins_fp32_on_a_cpu_with_bf16(monkeypatch, tmp_path: Path):
    from golden_sync import CASES, _raw

    monkeypatch.setenv(bf16.FLAGS_ENV, "avx512_bf16 amx_bf16")
    for name in CASES:
        cfg = build_config(_raw(tmp_path, (tmp_path / "t", tmp_path / "e"), **CASES[name]))
        policy = precision_policy(cfg.model, cfg.trainer, CPU)
        assert (policy["generator_dtype"], policy["trainer_precision"]) == ("float32", "fp32")
        assert policy["reason"] == "model.dtype and trainer.precision set in the config"


@pytest.mark.parametrize(
    ("flags", "dtype", "precision"),
    [("avx512_bf16", "bfloat16", "bf16_mixed"), ("avx2", "float32", "fp32")],
)
def test_the_start_line_and_the_summary_name_the_policy(
    monkeypatch, caplog, tiny_job, flags, dtype, precision
):
    monkeypatch.setenv(bf16.FLAGS_ENV, flags)
    cfg = tiny_job(
        model={"dtype": "auto"},
        trainer={"num_steps": 1, "precision": "auto"},
        checkpoint={"every_steps": 100},
    )
    with caplog.at_level(logging.INFO, logger="loomrl.session.run"):
        result = Job(cfg).run()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:"))
    assert f"generators compute in {dtype}, the trainer in {precision} on cpu" in line
    assert "model.dtype and trainer.precision 'auto'" in line
    assert ("has native bf16 (avx512_bf16" in line) == (dtype == "bfloat16")
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["precision"]["generator_dtype"] == dtype
    assert summary["precision"]["trainer_precision"] == precision
    assert summary["precision"]["reason"] in line
