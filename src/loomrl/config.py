"""Typed job configuration. Imports without torch, so ``loomrl --help`` answers fast.

One pydantic model per component; unknown keys are errors (``extra="forbid"``). A job is
a TOML file with one table per component; the CLI takes dotted overrides
(``trainer.lr=3e-4``). The fully resolved config is written to the run folder.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loomrl.generation.engine_config import EngineConfig, HFEngineConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(
        "tiny:llama",
        description="A local Hugging Face model folder, or a 'tiny:' spec built offline "
        "(e.g. 'tiny:llama', 'tiny:qwen2?hidden_size=128&num_layers=4').",
    )
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter instead of all weights."
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the trainer and generators compute: 'auto' (CUDA when present, else the CPU), "
        "'cpu', 'cuda' or 'cuda:<index>'.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the compute weights: the generators' model and the trainer's KL reference "
        "(the trainer's own weights follow trainer.precision). 'auto': bfloat16 on CUDA, float32 on the "
        "CPU, so CPU runs (and the golden record) compute exactly as before; set 'bfloat16' to try it on "
        "a CPU with bf16 instructions (avx512_bf16 / amx_bf16).",
    )


class LoraConfig(_Section):
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names to adapt."
    )


class DataConfig(_Section):
    train: str = Field(..., description="Training prompts: a local .jsonl or .parquet file.")
    eval: str | None = Field(None, description="Held-out prompts for evaluation (.jsonl/.parquet).")
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of {role, content} messages "
        "(TRL's conversational format; needs the chat template).",
    )
    chat_template: bool | Literal["auto"] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (with the generation prompt) "
        "and tokenize the result with no extra special tokens. 'auto': for prompts that are lists of "
        "messages, and for every prompt when system_prompt is set; false: never (a message list is then "
        "an error).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before each prompt's messages (a row that starts with a "
        "system message keeps its own); applies the chat template.",
    )
    max_eval_examples: int = Field(256, gt=0, description="Evaluate on at most this many rows.")
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch (seeded).")
    truncate_prompts: bool = Field(
        False,
        description="Cut prompts that do not fit the model's context with generation.max_new_tokens "
        "(keeping their end) instead of failing; the run log says how many were cut.",
    )
    max_prompt_bytes: int = Field(
        1 << 20,
        gt=0,
        description="A prompt longer than this many UTF-8 bytes is refused (naming its file and "
        "line) before it is tokenized; with truncate_prompts it is first cut to its last max_prompt_bytes bytes. "
        "Tokenizing a huge prompt costs ~400x its size in memory.",
    )

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError(
                "data.system_prompt is put in through the chat template; data.chat_template=false "
                "leaves it out: set chat_template to 'auto' or true, or drop system_prompt"
            )
        return self


class RewardSpec(_Section):
    """One of ``[[task.rewards]]``: a reward function and its weight in the total."""

    path: str = Field(..., description="Reward function by import path 'module:function'.")
    weight: float = Field(1.0, description="Its weight in the total reward (the weighted sum).")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name in the metrics (reward/<name>_mean); default: the function's name.",
    )
    signature: Literal["auto", "loomrl", "trl"] = Field(
        "auto",
        description="'loomrl': fn(prompt, completion, **row) -> float; 'trl': TRL's batched "
        "fn(prompts, completions, **columns) -> list[float]; 'auto': 'trl' when the function has a "
        "parameter named 'completions', else 'loomrl'.",
    )

    @property
    def label(self) -> str:
        """The name in the metrics."""
        return self.name or self.path.rpartition(":")[2]


class FunctionScorerConfig(_Section):
    """``[task.scorer] type = "function"``: a reward function, as ``task.reward`` names one."""

    type: Literal["function"] = Field("function", description="A Python reward function.")
    path: str = Field(
        ...,
        description="Reward function by import path 'module:function', called as fn(prompt, completion, **row) "
        "-> float (sync or async); the same as task.reward = path.",
    )


class ModelScorerConfig(_Section):
    """``[task.scorer] type = "model"``: a frozen Hugging Face sequence-classification reward model."""

    type: Literal["model"] = Field(
        "model", description="A reward model (AutoModelForSequenceClassification)."
    )
    path: str = Field(
        ...,
        description="A local Hugging Face reward-model folder (num_labels == 1), with its tokenizer.",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the scorer executor runs the model: 'auto' (CUDA when present, else the CPU), 'cpu', "
        "'cuda' or 'cuda:<index>'.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The model's dtype: 'auto' is bfloat16 on CUDA, float32 on the CPU."
    )
    max_tokens_per_batch: int = Field(
        8192,
        gt=0,
        description="A forward's padded tokens at most (rows x longest row); a longer row goes alone.",
    )
    normalize: bool = Field(
        False,
        description="Score as (score - running mean) / running std, over the scores this executor has seen.",
    )
    clip: float | None = Field(
        None, gt=0, description="Clip scores (after normalize) to [-clip, clip]; None: no clip."
    )


class JudgeScorerConfig(_Section):
    """``[task.scorer] type = "judge"``: a frozen generative judge, read by a parser."""

    type: Literal["judge"] = Field("judge", description="A generative judge.")
    path: str = Field(
        ..., description="The judge: a local Hugging Face causal LM folder or a 'tiny:' spec."
    )
    prompt_template: str = Field(
        ...,
        description="The judge's prompt, a Python format string over {prompt}, {completion} and the row's columns.",
    )
    parser: str = Field(
        ...,
        description="Import path 'module:function' taking the judge's text and returning a float; raising or "
        "returning None marks the judgement unparsed (a counted scoring failure, judge_unparsed).",
    )
    max_new_tokens: int = Field(
        32, gt=0, description="Tokens the judge generates per judgement at most (greedy)."
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the judge runs (as task.scorer.device).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The judge's dtype: 'auto' is bfloat16 on CUDA, float32 on the CPU."
    )
    max_tokens_per_batch: int = Field(
        8192,
        gt=0,
        description="A generate call's padded prompt tokens at most (rows x longest prompt).",
    )

    @model_validator(mode="after")
    def _template_parses(self) -> JudgeScorerConfig:
        import string

        try:
            list(string.Formatter().parse(self.prompt_template))
        except ValueError as err:
            raise ValueError(
                f"task.scorer.prompt_template {self.prompt_template!r} is not a Python format "
                f"string: {err}"
            ) from None
        return self


ScorerConfig = Annotated[
    FunctionScorerConfig | ModelScorerConfig | JudgeScorerConfig, Field(discriminator="type")
]


class TaskConfig(_Section):
    reward: str | None = Field(
        None,
        description="Reward function by import path 'module:function', called as "
        "fn(prompt, completion, **row) -> float (sync or async); TRL's batched signature "
        "fn(prompts, completions, **columns) -> list[float] is detected by its 'completions' parameter.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Several reward functions ([[task.rewards]] tables of path, weight, "
        "name, signature) in place of 'reward': the reward is their weighted sum, each logged as "
        "reward/<name>_mean; a failure of any one fails the rollout.",
    )
    environment: str | None = Field(
        None, description="Multi-turn Environment class by import path 'module:Class'."
    )
    scorer: ScorerConfig | None = Field(
        None,
        description="A scorer table instead of task.reward: type = 'function' (path), 'model' (a reward "
        "model folder) or 'judge' (a generative judge and its parser); see docs/scoring.md.",
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the Environment class."
    )
    max_turns: int = Field(4, gt=0, description="Turns per episode for multi-turn environments.")
    reward_timeout_s: float = Field(10.0, gt=0, description="A reward call past this fails.")
    max_failure_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the job when more than this fraction of the last "
        "`failure_window` rollouts failed scoring.",
    )
    failure_window: int = Field(256, gt=0, description="Rollouts in the failure-rate window.")
    num_scorers: int = Field(
        1,
        gt=0,
        description="Scorer executors that run the reward function (and its sandboxes), "
        "placed by the runtime; the controller load-balances reward batches over them.",
    )

    @model_validator(mode="after")
    def _one_scorer(self) -> TaskConfig:
        if self.reward is not None and self.rewards:
            raise ValueError(
                "task.reward and task.rewards both set: list the single reward in task.rewards too"
            )
        given = [
            name for name in ("reward", "rewards", "environment", "scorer") if getattr(self, name)
        ]
        if len(given) != 1:
            raise ValueError(
                f"task needs exactly one of 'reward' or 'environment' (or 'rewards' in place of "
                f"'reward', or a 'scorer' table), got {' and '.join(map(repr, given)) or 'none'}"
            )
        labels = [spec.label for spec in self.rewards]
        if len(set(labels)) < len(labels):
            raise ValueError(f"task.rewards names repeat ({labels}): give each a distinct 'name'")
        return self


class GenerationConfig(_Section):
    engine: EngineConfig = Field(
        default_factory=HFEngineConfig,
        description="Generation engine: "
        "[generation.engine] type = 'hf' or 'vllm' with its settings (docs/engines.md); engine = 'hf' too.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(16, gt=0, description="Tokens generated per turn at most.")
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a sequence stops sampling once it holds one, and its "
        "completion is cut before the first (the tokens up to the one that completes it are kept for "
        "training; finish reason 'stop'). "
        "Generation also stops on every EOS id of the model's generation_config.",
    )

    @model_validator(mode="after")
    def _stop_strings_not_empty(self) -> GenerationConfig:
        if "" in self.stop:
            raise ValueError(
                "generation.stop holds an empty string, which every completion holds; remove it"
            )
        return self

    prompts_per_request: int = Field(
        4, gt=0, description="Prompt groups batched into one generate call."
    )
    num_generators: int = Field(1, gt=0, description="Generator executors.")
    trace: bool | Literal["auto"] = Field(
        "auto",
        description="Forward passes from TorchScript traces, one per batch shape: bit-identical "
        "to eager, and no GIL held while they run. 'auto': on where executors share a process "
        "(runtime='local') and the model is on the CPU, the one place that pays for the tracing; "
        "off on CUDA, where the GIL is not what limits a forward and the traces cost time (26% of "
        "a 0.36B Qwen2 RL step on an H200). Eager for PEFT and non-DynamicCache models, or after a "
        "trace fails.",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="Decode on a preallocated (static) key/value cache with each decode step "
        "replayed from a CUDA graph: one launch a token instead of hundreds. 'auto': on where the "
        "model is on a CUDA device. On a CPU device, true decodes on the static cache without graphs "
        "(for tests); the default there is the dynamic-cache loop. Dynamic cache for PEFT, sliding-"
        "window or non-sdpa/eager attention models, and after a capture fails (docs/engines.md).",
    )

    quantize: Literal["none", "int8", "fp8"] = Field(
        "none",
        description="Weight precision of the generators' Linear layers (not the output head, not "
        "the embeddings): 'int8' per-output-channel int8 (CPU: torch's dynamic int8 matmuls; CUDA: "
        "weight-only), 'fp8' e4m3 with per-channel scales through torch._scaled_mm (CUDA only: a "
        "start error elsewhere). The generator keeps the published weights unquantized and "
        "re-quantizes what each update changes; the behaviour log-probs are the quantized model's, "
        "so the loss's importance ratio ('aipo', 'tis') corrects the mismatch (docs/engines.md).",
    )

    def resolve_trace(self, runtime: str, device_type: str) -> bool:
        """``trace`` for a generator whose model is on ``device_type`` ('cpu', 'cuda')."""
        if self.trace == "auto":
            return runtime == "local" and device_type == "cpu"
        return bool(self.trace)

    def resolve_cuda_graphs(self, device_type: str) -> bool:
        """``cuda_graphs`` for a generator whose model is on ``device_type``."""
        return device_type == "cuda" if self.cuda_graphs == "auto" else bool(self.cuda_graphs)


class AlgorithmConfig(_Section):
    loss: Literal["pg", "grpo", "aipo", "tis"] = Field(
        "aipo", description="Policy loss; 'pg' is plain policy gradient with no importance weight."
    )
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    groups_per_step: int = Field(8, gt=0, description="Groups per optimizer step (B).")
    max_staleness: int = Field(
        1, ge=0, description="Max versions a rollout may lag when trained; 0 = synchronous."
    )
    delta: float = Field(2.0, gt=0, description="Truncation of the importance weight (AIPO/TIS).")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (grpo/tis).")
    advantage_scale: Literal["none", "std"] = Field(
        "none", description="Divide group-centred rewards by the group's std."
    )
    aggregation: Literal["token", "sequence"] = Field("token", description="Loss averaging.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the initial model (0 = off). The frozen reference is kept "
        "in model.dtype's compute dtype (bf16 on CUDA by default), not as a second fp32 copy.",
    )


class ParallelConfig(_Section):
    """``[trainer.parallel]``: one trainer process, or N ranks sharding it with FSDP2
    (docs/training.md, "Sharded training")."""

    type: Literal["single", "fsdp2"] = Field(
        "single",
        description="'single': one trainer process holds the whole model, its gradients and AdamW "
        "state. 'fsdp2': dp_shard ranks (one process or Ray actor each, one torch.distributed group: "
        "gloo on CPU, NCCL on CUDA) each hold 1/dp_shard of them (torch's fully_shard per transformer "
        "block); a step's rollouts are split over the ranks by tokens.",
    )
    dp_shard: int = Field(1, ge=1, description="'fsdp2': ranks the model is sharded over.")
    reshard_after_forward: bool = Field(
        True,
        description="'fsdp2': free each block's gathered weights after its forward and gather them "
        "again in backward (less memory, one more all-gather per block); false keeps them to backward.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="'fsdp2': the process group's timeout: a collective that waits longer for a lost "
        "rank fails instead of hanging (the call deadline then ends the group).",
    )


class TrainerConfig(_Section):
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    micro_batch_size: int = Field(64, gt=0, description="Rollouts per forward/backward.")
    shared_prefix: bool = Field(
        True,
        description="Run each distinct prompt of a micro-batch once and its completions on its "
        "key/value cache (same loss up to float order, far less work with groups of short completions).",
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
        "runtime='local' (see generation.trace). Eager for PEFT models, gradient checkpointing, "
        "chunked log-probs (trainer.chunked_logprobs), precisions other than fp32, "
        "or after a trace fails.",
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
        "updates below bf16's resolution are lost). 'auto': bf16_mixed on CUDA, fp32 on the CPU. "
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
        "log-softmax of a whole micro-batch. 'auto': on, except fp32 training on the CPU, which keeps "
        "the full computation (its sums round in another order, and the golden record is bit-exact).",
    )
    logprob_chunk_tokens: int = Field(
        512,
        gt=0,
        description="Tokens per chunk of the chunked log-probs: about 2 x this x vocabulary x 4 bytes "
        "alive at once (0.6 GB for 512 tokens of a 151,936-token vocabulary).",
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
        default_factory=ParallelConfig,
        description="Single-process or sharded (FSDP2) training.",
    )


class WeightSyncConfig(_Section):
    codec: Literal["full", "delta"] = Field("full", description="Full copies or lossless deltas.")
    transport: Literal["inproc", "shm", "torch_dist", "files", "tensor"] = Field(
        "inproc",
        description="How updates travel from trainer to generators: a byte lane (inproc, shm, "
        "torch_dist, files; the codec) or the tensor lane ('tensor': device tensors, no codec; docs/weights.md).",
    )
    publish_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of published weights (trainer keeps fp32 masters)."
    )
    full_every: int = Field(
        50, gt=0, description="With deltas: a full snapshot every this many versions."
    )
    sync_every: int = Field(1, gt=0, description="Publish every this many optimizer steps.")
    path: str | None = Field(None, description="Folder or fsspec URL for the 'files' transport.")
    zstd_level: int = Field(
        1, ge=1, le=22, description="zstd level of the delta codec (1 is fastest)."
    )
    prefetch: bool = Field(
        False,
        description="Generators receive and verify updates in a background thread and "
        "pause only to apply them.",
    )
    keep_fulls: int = Field(
        2, gt=0, description="'files' transport: full snapshots kept (with the deltas after them)."
    )
    bucket_mb: int = Field(
        64, gt=0, description="'torch_dist' transport: broadcast bucket size in MiB."
    )
    tensor_mode: Literal["auto", "broadcast"] = Field(
        "auto",
        description="'tensor' transport: 'auto' shares the buffer in one process (runtime local) and by "
        "CUDA IPC across processes on one GPU (the byte lane 'shm' where the models are on CPUs); 'broadcast' "
        "broadcasts it over a torch_dist group (a GPU per process with dist_backend='nccl', or gloo).",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Backend of the 'torch_dist' group and of tensor_mode='broadcast': 'auto' is gloo; "
        "'nccl' needs a GPU of its own per executor.",
    )

    @property
    def forms_group(self) -> bool:
        """Whether generators join a torch_dist group (a restarted process cannot rejoin it)."""
        return self.transport == "torch_dist" or (
            self.transport == "tensor" and self.tensor_mode == "broadcast"
        )


class SandboxConfig(_Section):
    backend: Literal["auto", "bwrap", "process"] = Field(
        "auto", description="Isolation backend; 'auto' takes bwrap where installed."
    )
    min_warm: int = Field(2, ge=0, description="Warm sandboxes kept ready at least.")
    max_warm: int = Field(16, gt=0, description="Warm sandboxes kept ready at most.")
    max_sandboxes: int = Field(32, gt=0, description="Sandboxes alive at most (backpressure).")
    timeout_s: float = Field(5.0, gt=0, description="Default wall time per exec.")
    memory_mb: int = Field(512, gt=0, description="Address-space / memory limit per sandbox.")
    cpu_s: int = Field(10, gt=0, description="CPU seconds per exec (RLIMIT_CPU).")
    max_processes: int = Field(
        64, gt=0, description="Processes per sandbox (RLIMIT_NPROC, pids cgroup)."
    )
    max_output_bytes: int = Field(
        1 << 20, gt=0, description="stdout+stderr bytes kept per exec; more kills it (output_cap)."
    )
    ttl_s: float = Field(600.0, gt=0, description="A sandbox retires after this many seconds.")
    max_retries: int = Field(
        2,
        ge=0,
        description="Retries of an exec after sandbox infrastructure failures (never for the code's own failures).",
    )
    uid_base: int = Field(
        880_000, gt=0, description="First of the dedicated unprivileged uids sandboxes run code as."
    )
    allow_no_memory_limit: bool = Field(
        False,
        description="Run sandboxes even where no cgroup (v1 or v2) can bound their memory "
        "(not root, or no writable memory/pids controllers); otherwise the pool refuses to start.",
    )

    @model_validator(mode="after")
    def _pool_sizes_nest(self) -> SandboxConfig:
        if not self.min_warm <= self.max_warm <= self.max_sandboxes:
            raise ValueError(
                f"sandbox sizes must satisfy min_warm <= max_warm <= max_sandboxes, got min_warm={self.min_warm}, "
                f"max_warm={self.max_warm}, max_sandboxes={self.max_sandboxes}"
            )
        return self


class FaultsConfig(_Section):
    """Self-healing: what happens when an executor dies or stops answering."""

    max_restarts: int = Field(
        2,
        ge=0,
        description="Times the job restarts itself from its last checkpoint after the trainer dies "
        "or hangs (0: the job fails, and `loomrl resume` continues it).",
    )
    max_executor_restarts: int = Field(
        10,
        ge=0,
        description="Generator and scorer restarts allowed in one run, all together; past it the job fails.",
    )
    deadline_factor: float = Field(
        10.0,
        gt=1,
        description="A call's deadline: this many times the longest call of that method seen so far "
        "(per executor role); an executor whose call runs past it is killed and replaced.",
    )
    min_deadline_s: float = Field(60.0, gt=0, description="No deadline is shorter than this.")
    first_call_deadline_s: float = Field(
        900.0,
        gt=0,
        description="The deadline before a method has `deadline_calls` observed calls (a first "
        "call also waits for its executor to load its model).",
    )
    deadline_calls: int = Field(
        3, gt=0, description="Observed calls of a method before its deadline adapts."
    )


class CheckpointConfig(_Section):
    every_steps: int = Field(50, gt=0, description="Checkpoint every this many steps.")
    keep: int = Field(2, gt=0, description="Checkpoints kept (oldest deleted first).")


class EvalConfig(_Section):
    every_steps: int = Field(25, gt=0, description="Evaluate every this many steps.")


class LoggingConfig(_Section):
    """What the run folder records besides metrics.jsonl."""

    completions_per_step: int = Field(
        4,
        ge=0,
        description="(prompt, completion, reward) samples written to samples.jsonl (and TensorBoard "
        "text) per step: the first completion of each of this many of the step's groups, as text. 0: none.",
    )
    zero_variance_warning_every_steps: int = Field(
        20,
        gt=0,
        description="Warn when more than half of a step's groups got the same reward for every "
        "completion (nothing to learn from them), at most once every this many steps.",
    )


class SchedulerConfig(_Section):
    url: str | None = Field(
        None,
        description="A time-slicing scheduler to share devices with other jobs (`loomrl scheduler serve`, "
        "e.g. 'http://127.0.0.1:7878'): each device phase (generate, train, weight sync, checkpoint) then "
        "runs in a lease. None: this job has its devices to itself.",
    )
    device: str = Field(
        "cpu0", description="The scheduler's name of the device this job's phases run on."
    )
    priority: int = Field(
        0,
        ge=-1_000_000,
        le=1_000_000,
        description="Priority under the scheduler's 'priority' policy (higher first).",
    )
    weight: float = Field(
        1.0,
        ge=1e-3,
        le=1e3,
        description="Share under the 'fair' policy (device-seconds in proportion; the daemon "
        "refuses weights outside 0.001..1000).",
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        ge=0.05,
        le=3600,
        description="Past this without a heartbeat the scheduler takes this job's leases "
        "away (the daemon refuses values outside 0.05..3600 s).",
    )
    acquire_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail the job when a phase waits longer than this for its device (None: wait).",
    )
    offload: bool = Field(
        True,
        description="Move the trainer's and generators' state off the device when another job takes it.",
    )
    pin: bool = Field(
        True, description="On a CPU device, run the job's threads on its cores during a phase."
    )


class RayCpus(_Section):
    trainer: float = Field(1.0, ge=0, description="Ray CPUs the trainer actor asks for.")
    generator: float = Field(1.0, ge=0, description="Ray CPUs each generator actor asks for.")
    scorer: float = Field(1.0, ge=0, description="Ray CPUs each scorer actor asks for.")


class RayGpus(_Section):
    trainer: float = Field(0.0, ge=0, description="GPUs the trainer actor asks for.")
    generator: float = Field(0.0, ge=0, description="GPUs each generator actor asks for.")
    scorer: float = Field(0.0, ge=0, description="GPUs each scorer actor asks for.")


class RayMemory(_Section):
    trainer: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for the trainer actor."
    )
    generator: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for each generator actor."
    )
    scorer: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for each scorer actor."
    )


class RayConfig(_Section):
    """``runtime = "ray"``: every executor is a Ray actor; its role (trainer, generator,
    scorer: the executor name's prefix) picks its resources."""

    address: str | None = Field(
        None,
        description="None: use the Ray this process already initialized, else $RAY_ADDRESS, else start a "
        "local cluster (shut down at the end); 'auto', 'host:port' or 'ray://host:port': connect to a running cluster.",
    )
    namespace: str | None = Field(
        None, description="Ray namespace of the job's actors (None: Ray's default)."
    )
    num_cpus: RayCpus = Field(default_factory=RayCpus)
    num_gpus: RayGpus = Field(default_factory=RayGpus)
    memory_mb: RayMemory = Field(default_factory=RayMemory)
    placement: Literal["pack", "spread"] | None = Field(
        None,
        description="Reserve one placement-group bundle per executor, packed on few nodes or spread "
        "over many (None: Ray places each actor where it fits).",
    )
    object_store_mb: int | None = Field(
        None,
        gt=0,
        description="Object store of a local cluster this job starts (None: Ray's default).",
    )
    runtime_env: dict[str, Any] | None = Field(
        None,
        description="Ray runtime_env for the job's workers (e.g. {working_dir = '.'}), where this job initializes Ray.",
    )


class JobConfig(_Section):
    name: str = Field("job", description="Job name; the run folder is named after it.")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    output_dir: str | None = Field(None, description="Run folder; default runs/<name>-<timestamp>.")
    runtime: Literal["local", "process", "ray"] = Field(
        "local",
        description="Where executors live: 'local' (threads of this process), 'process' "
        "(one spawned process each, no shared GIL) or 'ray' (Ray actors, see [ray]); the last two "
        "send weights by shm, files or torch_dist.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The controller's event loop: 'uvloop' (libuv; its turns and cross-thread "
        "wake-ups cost the controller less CPU), 'asyncio' (the standard library's) or 'auto' "
        "(uvloop where it is installed, else asyncio).",
    )
    stall_warning_s: float = Field(
        300.0,
        gt=0,
        description="Warn when one executor call (generate, train_step, publish ...) runs longer than this.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    task: TaskConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _transport_fits_runtime(self) -> JobConfig:
        ws = self.weight_sync
        if self.runtime in ("process", "ray") and ws.transport == "inproc":
            if "transport" in ws.model_fields_set:
                raise ValueError(
                    "weight_sync.transport='inproc' only reaches executors in this process; "
                    f"runtime={self.runtime!r} needs 'shm' (the default there; one node only), 'files' or 'torch_dist'"
                )
            ws.transport = "shm"
        if self.runtime == "local" and ws.transport == "torch_dist":
            raise ValueError(
                "weight_sync.transport='torch_dist' needs one process per executor; the local "
                "runtime runs executors as threads: use runtime='process', or 'inproc' or 'shm'"
            )
        return self

    @model_validator(mode="after")
    def _parallel_fits_job(self) -> JobConfig:
        par = self.trainer.parallel
        if par.type != "fsdp2":
            return self
        if self.runtime == "local":
            raise ValueError(
                "trainer.parallel.type='fsdp2' needs one process per rank (a process has one default "
                "torch.distributed group); runtime='local' runs executors as threads: use "
                "runtime='process' (or 'ray')"
            )
        if self.weight_sync.forms_group:
            raise ValueError(
                f"trainer.parallel.type='fsdp2' with weight_sync.transport={self.weight_sync.transport!r} "
                f"(tensor_mode={self.weight_sync.tensor_mode!r}): the ranks' process group is the default "
                "one, which the weight-sync group would need too; use transport 'shm' or 'files'"
            )
        if self.model.lora is not None:
            raise ValueError(
                "trainer.parallel.type='fsdp2' with model.lora: sharded LoRA training is not built "
                "yet; drop [model.lora] or set parallel.type='single'"
            )
        if self.algorithm.kl_coef > 0:
            raise ValueError(
                f"trainer.parallel.type='fsdp2' with algorithm.kl_coef={self.algorithm.kl_coef}: the "
                "sharded KL reference is not built yet; set kl_coef=0 or parallel.type='single'"
            )
        if self.scheduler.url is not None and self.scheduler.offload:
            raise ValueError(
                "trainer.parallel.type='fsdp2' with scheduler.url and scheduler.offload: a sharded "
                "trainer cannot be offloaded yet; set scheduler.offload=false or parallel.type='single'"
            )
        return self

    @model_validator(mode="after")
    def _sync_keeps_rollouts_fresh(self) -> JobConfig:
        # Generators hold the last published version, up to sync_every - 1 behind the
        # trainer; past max_staleness every rollout is dropped and no step ever completes.
        every, stale = self.weight_sync.sync_every, self.algorithm.max_staleness
        if every > stale + 1:
            raise ValueError(
                f"weight_sync.sync_every={every} with algorithm.max_staleness={stale}: generators would "
                f"lag up to {every - 1} versions, so every rollout would be dropped as stale and the job "
                f"would hang; set sync_every <= max_staleness + 1 = {stale + 1}"
            )
        return self

    def uses_traces(self, setting: bool | str) -> bool:
        """A ``trace`` setting resolved: 'auto' traces where executors share a process."""
        return self.runtime == "local" if setting == "auto" else bool(setting)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


ModelConfig.model_rebuild()


class ConfigError(ValueError):
    """A job file or override that does not describe a valid job."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'trainer.lr=3e-4'`` -> ``(['trainer', 'lr'], 3e-4)``; values parse as TOML, else str."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a table")
            node = child
        node[path[-1]] = value
    return raw


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid job config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (check the spelling; see `loomrl config`)")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {loc}: {e['msg']}{got_text}")
    return "\n".join(lines)


def build_config(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read a TOML job file (relative data/model paths resolve from the working dir)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return build_config(apply_overrides(raw, overrides or []), str(path))
