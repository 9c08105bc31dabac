"""``[trainer]`` and ``[trainer.parallel]``: the optimizer, its schedule and precision, and how
the trainer is laid out (one process, or FSDP2 ranks)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from loomrl.config_base import Section


class SingleParallelConfig(Section):
    """``[trainer.parallel] type = "single"``: one trainer process."""

    type: Literal["single"] = Field(
        "single",
        description="One trainer process holds the whole model, its gradients and AdamW state.",
    )


class Fsdp2ParallelConfig(Section):
    """``[trainer.parallel] type = "fsdp2"``: N ranks sharding the trainer with FSDP2
    (docs/training.md, "Sharded training")."""

    type: Literal["fsdp2"] = Field(
        "fsdp2",
        description="dp_shard ranks (one process or Ray actor each, one torch.distributed group: "
        "gloo on CPU, NCCL on CUDA) each hold 1/dp_shard of the model, its gradients and AdamW state "
        "(torch's fully_shard per transformer block); a step's rollouts are split over the ranks by tokens.",
    )
    dp_shard: int = Field(1, ge=1, description="Ranks the model is sharded over.")
    reshard_after_forward: bool = Field(
        True,
        description="Free each block's gathered weights after its forward and gather them "
        "again in backward (less memory, one more all-gather per block); false keeps them to backward.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="The process group's timeout: a collective that waits longer for a lost "
        "rank fails instead of hanging (the call deadline then ends the group).",
    )


ParallelConfig = Annotated[SingleParallelConfig | Fsdp2ParallelConfig, Field(discriminator="type")]

# fsdp2's keys and their defaults: what a config.json written before the tagged table lists
# under type = "single" too (dropped there when at their defaults).
_FSDP2_DEFAULTS = {"dp_shard": 1, "reshard_after_forward": True, "collective_timeout_s": 600.0}


def _tagged_parallel(table: Any) -> Any:
    """``[trainer.parallel]`` with its type (default 'single') and without fsdp2's keys at
    their defaults under 'single'; an fsdp2 key set under 'single' is an error naming it."""
    if isinstance(table, str):  # parallel = "fsdp2": the type alone
        return {"type": table}
    if not isinstance(table, dict):
        return table
    table = {"type": "single", **table}
    if table["type"] != "single":
        return table
    for key, default in _FSDP2_DEFAULTS.items():
        if key in table:
            if table[key] != default:
                raise ValueError(
                    f"trainer.parallel.{key}={table[key]!r} is a key of type 'fsdp2', and "
                    "trainer.parallel.type is 'single': set type = 'fsdp2' or remove it"
                )
            del table[key]
    return table


class TrainerConfig(Section):
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    micro_batch_size: int = Field(64, gt=0, description="Rollouts per forward/backward.")
    shared_prefix: bool | Literal["auto"] = Field(
        "auto",
        description="Run each distinct prompt of a micro-batch once and its completions on its "
        "key/value cache (same loss up to float order, far less work with groups of short completions). "
        "'auto': on, except under parallel.type='fsdp2' (one forward per micro-batch on every rank), "
        "where true is an error.",
    )
    fused_optimizer: bool = Field(
        True,
        description="AdamW's fused kernel (torch's fused=True, on CPU and CUDA): one op for "
        "all parameters instead of a dozen per tensor; about 3x faster on the demo model, and "
        "rounds differently from the per-tensor loop (weights within ~1e-7 after a step).",
    )
    trace: bool | Literal["auto"] = Field(
        "auto",
        description="The training forward from TorchScript traces, one per batch shape: the "
        "same loss and gradients bit for bit, and no GIL held while it runs. 'auto': on for "
        "runtime='local' (see generation.engine.trace). Eager for PEFT models, gradient checkpointing, "
        "chunked log-probs (trainer.chunked_logprobs), precisions other than fp32, "
        "or after a trace fails. Off under parallel.type='fsdp2', where true is an error.",
    )
    num_steps: int = Field(100, gt=0, description="Optimizer steps in the job.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning-rate decay after warmup: to 0 at num_steps for linear/cosine.",
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warmup.")
    precision: Literal["auto", "fp32", "bf16_mixed", "bf16"] = Field(
        "auto",
        description="'fp32': fp32 weights, AdamW state and compute. 'bf16_mixed': fp32 master "
        "weights and AdamW state, the forward and backward under bf16 autocast (FSDP2's "
        "MixedPrecisionPolicy model). 'bf16': weights and AdamW state in bf16 (half the memory, "
        "updates below bf16's resolution are lost). 'auto': bf16_mixed where the device "
        "computes bf16 natively (CUDA; a CPU with AVX512-BF16, AMX-BF16 or Arm BF16), fp32 elsewhere; "
        "the run's start line and summary.json say which and why. "
        "Log-probs, the loss and the importance ratio are computed in fp32 under every policy.",
    )
    tf32: bool = Field(
        True,
        description="Allow TF32 tensor cores for fp32 matmuls on CUDA "
        "(torch.set_float32_matmul_precision('high'), for the whole process); no effect on the CPU.",
    )
    chunked_logprobs: bool | Literal["auto"] = Field(
        "auto",
        description="Log-probs and entropy from the final hidden states a chunk of tokens at a "
        "time (logits in fp32 per chunk, recomputed in backward), never the [tokens, vocabulary] "
        "log-softmax of a whole micro-batch. 'auto': on, except fp32 training on the CPU with a "
        "vocabulary under trainer.chunked_logprobs_min_vocab, which keeps the full computation (its "
        "sums round in another order, and the golden record is bit-exact), and under "
        "parallel.type='fsdp2' (the output projection is a shard outside the root's forward), where "
        "true is an error.",
    )
    chunked_logprobs_min_vocab: int = Field(
        32_768,
        gt=0,
        description="Under chunked_logprobs='auto', fp32 training on the CPU chunks the log-probs "
        "of a model whose output vocabulary has at least this many rows (where the [tokens, "
        "vocabulary] log-softmax holds the step's peak); smaller vocabularies keep the full path.",
    )
    logprob_chunk_tokens: int = Field(
        512,
        gt=0,
        description="Tokens per chunk of the chunked log-probs: about 2 x this x vocabulary x 4 bytes "
        "alive at once (0.6 GB for 512 tokens of a 151,936-token vocabulary).",
    )
    packing: bool = Field(
        False,
        description="Pack each micro-batch's sequences end to end in one row (position ids "
        "restarting per sequence, attention kept within each by a block-diagonal mask, or "
        "flash-attention's varlen path from the position ids) instead of padding every row to the "
        "longest: no compute on padding. A micro-batch holds at most micro_batch_size rollouts and "
        "packing_max_tokens tokens; a longer rollout is a pack of its own. Same loss, log-probs and "
        "gradients up to float order. Turns off shared_prefix ('auto'; true is an error) and traces.",
    )
    packing_max_tokens: int = Field(
        2048,
        gt=0,
        description="trainer.packing's token budget per micro-batch (the packed row's length). "
        "Under SDPA/eager attention a pack's attention is one [tokens, tokens] block under the mask, "
        "so its cost grows with this budget squared (on the CPU 4096 was slower than padding, "
        "bench/packing.py); flash-attention's varlen path has no such block: raise it there.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Cap a micro-batch's padded tokens (rows x longest row) as well as its rows "
        "(micro_batch_size); a longer row goes alone. None: rows only. Same loss and gradients "
        "up to float order.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each layer's activations in backward (the model's own "
        "gradient checkpointing, non-reentrant): less memory, ~30% more compute. Turns off "
        "trainer.shared_prefix (checkpointed layers keep no key/value cache) and traces.",
    )
    parallel: ParallelConfig = Field(
        default_factory=SingleParallelConfig,
        description="Single-process or sharded (FSDP2) training, a table tagged by type: 'single' "
        "or 'fsdp2' (dp_shard, reshard_after_forward, collective_timeout_s).",
    )

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel_tagged(cls, table: Any) -> Any:
        return _tagged_parallel(table)

    @model_validator(mode="after")
    def _packing_is_its_own_forward(self) -> TrainerConfig:
        # a packed row has no per-row prompt to share a key/value cache from
        if self.packing and self.shared_prefix is True:
            raise ValueError(
                "trainer.packing=true runs every sequence in one packed row, and "
                "trainer.shared_prefix=true would run each prompt once on a key/value cache shared "
                "by its rows: they cannot combine; set shared_prefix='auto' (off under packing) "
                "or packing=false"
            )
        return self

    @model_validator(mode="after")
    def _sharded_takes_its_own_path(self) -> TrainerConfig:
        # a sharded step runs one forward and one backward per micro-batch on every rank
        # (collectives in lockstep): these would be silently off there
        if self.parallel.type != "fsdp2":
            return self
        asked = [k for k in _SINGLE_ONLY if k in self.model_fields_set and getattr(self, k) is True]
        if asked:
            raise ValueError(
                "trainer.parallel.type='fsdp2' runs without "
                + ", ".join(f"trainer.{k}" for k in asked)
                + f" ({'; '.join(_SINGLE_ONLY[k] for k in asked)}): set "
                + ", ".join(f"{k}='auto'" for k in asked)
                + " (off there), or parallel.type='single'"
            )
        return self


# What the fsdp2 trainer cannot run, and why (loomrl.training.fsdp.ShardedTrainer).
_SINGLE_ONLY = {
    "shared_prefix": "a shared-prompt forward is a second forward per micro-batch",
    "trace": "no traces of a sharded model are built",
    "chunked_logprobs": "the output projection is still a shard outside the root's forward",
}
