"""What spans sections of a job config and is checked when ``JobConfig`` is built (each
rule raises ``ValueError`` naming the keys to change): the sharded trainer's needs, the
colocated mode's and quantized publishing's. ``JobConfig`` calls ``check_job``; the rules read only config."""

from __future__ import annotations

from typing import Any

JobConfig = Any  # loomrl.config.JobConfig (which imports this module)


def check_job(cfg: JobConfig) -> None:
    parallel_fits_job(cfg)
    colocate_fits_job(cfg)
    quantized_publish_fits_job(cfg)


def parallel_fits_job(cfg: JobConfig) -> None:
    if cfg.trainer.parallel.type != "fsdp2":
        return
    if cfg.runtime == "local":
        raise ValueError(
            "trainer.parallel.type='fsdp2' needs one process per rank (a process has one default "
            "torch.distributed group); runtime='local' runs executors as threads: use "
            "runtime='process' (or 'ray')"
        )
    if cfg.weight_sync.forms_group:
        raise ValueError(
            f"trainer.parallel.type='fsdp2' with weight_sync.transport={cfg.weight_sync.kind!r} "
            "(a torch_dist group): the ranks' process group is the default one, which the "
            "weight-sync group would need too; use transport 'shm' or 'files'"
        )
    if cfg.model.lora is not None:
        raise ValueError(
            "trainer.parallel.type='fsdp2' with model.lora: sharded LoRA training is not built "
            "yet; drop [model.lora] or set parallel.type='single'"
        )
    if cfg.algorithm.kl_coef > 0:
        raise ValueError(
            f"trainer.parallel.type='fsdp2' with algorithm.kl_coef={cfg.algorithm.kl_coef}: the "
            "sharded KL reference is not built yet; set kl_coef=0 or parallel.type='single'"
        )
    if cfg.scheduler.url is not None and cfg.scheduler.offload:
        raise ValueError(
            "trainer.parallel.type='fsdp2' with scheduler.url and scheduler.offload: a sharded "
            "trainer cannot be offloaded yet; set scheduler.offload=false or parallel.type='single'"
        )


def colocate_fits_job(cfg: JobConfig) -> None:
    """``generation.colocate``: the generators and one trainer take turns on one device."""
    if not cfg.generation.colocate:
        return
    if cfg.scheduler.url is not None:
        raise ValueError(
            "generation.colocate=true with scheduler.url: the scheduler's leases already offload "
            "this job's executors between its phases; use one or the other"
        )
    if cfg.trainer.parallel.type != "single":
        raise ValueError(
            f"generation.colocate=true with trainer.parallel.type={cfg.trainer.parallel.type!r}: "
            "colocation puts one trainer and the generators on one device; use parallel.type='single'"
        )
    if cfg.weight_sync.prefetch:
        raise ValueError(
            "generation.colocate=true with weight_sync.prefetch=true: a prefetch thread reads the "
            "generator's weights while they are offloaded; set prefetch=false"
        )


def quantized_publish_fits_job(cfg: JobConfig) -> None:
    """``weight_sync.publish_quantized``: the trainer sends codes and scales, which only the
    hf engine's quantized Linear layers take."""
    if not cfg.weight_sync.publish_quantized:
        return
    gen = cfg.generation
    if gen.quantize == "none":
        raise ValueError(
            "weight_sync.publish_quantized=true with generation.quantize='none': there is nothing "
            "to publish quantized; set generation.quantize='int8' or 'fp8', or publish_quantized=false"
        )
    if gen.quantize == "int4":
        raise ValueError(
            "weight_sync.publish_quantized=true with generation.quantize='int4': the trainer "
            "publishes int8 or fp8 codes; an int4 generator quantizes what it receives: set "
            "publish_quantized=false"
        )
    if gen.engine.type != "hf":
        raise ValueError(
            f"weight_sync.publish_quantized=true with generation.engine.type={gen.engine.type!r}: "
            "only the hf engine loads published codes and scales; set publish_quantized=false"
        )
    if cfg.model.lora is not None:
        raise ValueError(
            "weight_sync.publish_quantized=true with model.lora: a LoRA job publishes its adapter "
            "only, which is not quantized; set publish_quantized=false"
        )
    if cfg.weight_sync.kind == "tensor":
        raise ValueError(
            "weight_sync.publish_quantized=true with weight_sync.transport type 'tensor': the tensor "
            "lane publishes one dtype; use a byte lane ('inproc', 'shm', 'files', 'torch_dist')"
        )
