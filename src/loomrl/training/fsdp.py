"""The sharded trainer (``[trainer.parallel] type = "fsdp2"``): N ranks, one process (or Ray
actor) each, in one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), started by
``loomrl.runtime.group.start_group`` behind one trainer handle.

Each rank holds 1/N of the weights, gradients and AdamW state: the model is wrapped with
``torch.distributed.fsdp.fully_shard`` per transformer block, then at the root (with a
``MixedPrecisionPolicy`` under ``trainer.precision = "bf16_mixed"``), and the optimizer is
built on the sharded parameters. From a model folder the model starts on the meta device and
each rank reads only its shards (``loomrl.training.fsdp_init``). A step:

1. every rank gets the whole step's groups (the group handle sends all ranks the same
   arguments), computes every advantage and the global token count, and takes its share of
   the rollouts: ``shard_rollouts`` balances prompt + completion tokens, deterministically;
2. the loss of each micro-batch is weighted by its tokens over the *global* count (as the
   single trainer does), and FSDP's reduce-scatter sums the ranks' gradients (its default
   divide-by-N is turned off), so N ranks make the update one trainer makes;
3. every rank runs as many forward/backward passes (a collective each): a rank with fewer
   micro-batches runs idle ones (a row's forward, backward of zero);
4. the statistics of every rank are merged (``all_gather_object``), so rank 0's answer,
   the one the handle returns, is the step's.

Publishing: rank 0 publishes; every rank joins a ``DTensor.full_tensor()`` per parameter as
the publisher reads it (``GatheredParams``), so one full parameter exists at a time beyond the
publisher's own cast copy.

Checkpoints are sharded (``loomrl.training.dcp``): every rank writes its shards of the
model and AdamW state with ``torch.distributed.checkpoint`` into the checkpoint's
``trainer/``, rank 0 the rest (scheduler, version, the controller's state) in the single
trainer's folder format, with every file's sha256 in the manifest. They load on any rank
count, and on ``type = "single"``. The full (gathered) ``state_dict`` remains for
``save_pretrained`` and for tests.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loomrl.device import resolve_device
from loomrl.runtime.base import Runtime
from loomrl.runtime.group import ExecutorGroup, start_group
from loomrl.runtime.group_store import init_process_group
from loomrl.training import precision as prec
from loomrl.training.base import TrainerEndpoints
from loomrl.training.checkpoint import SHARDED_FORMAT
from loomrl.training.dcp import load_trainer_state, save_sharded_checkpoint
from loomrl.training.executor import TrainerExecutor, TrainerSetup
from loomrl.training.fsdp_init import start_sharded_model
from loomrl.training.optim_state import apply_optimizer_config
from loomrl.training.trainer import (
    Trainer,
    _Accumulator,
    token_logprobs,
)
from loomrl.types import Rollout
from loomrl.weights.transports import TransportSpec, open_transport

logger = logging.getLogger(__name__)


def shard_rollouts(rollouts: list[Rollout], world_size: int) -> list[list[int]]:
    """The indices of ``rollouts`` each rank trains, balanced by tokens (prompt +
    completion, what a row costs): longest first onto the rank with the fewest tokens so far
    (ties: the lower index, the lower rank), each rank's rows in their original order. The
    same answer on every rank, with no collective."""
    cost = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(rollouts)), key=lambda i: (-cost[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += cost[i]
    return [sorted(share) for share in shares]


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of its largest ``ModuleList``
    (``model.layers`` of Llama and Qwen, ``transformer.h`` of GPT-2)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"trainer.parallel.type='fsdp2': {type(model).__name__} has no ModuleList of "
            "transformer blocks to shard"
        )
    return list(max(lists, key=len))


def shard_model(model: torch.nn.Module, mesh, precision: str, reshard: bool) -> None:
    """``fully_shard`` each transformer block, then the root (the embeddings, final norm and
    output projection), in place; bf16 compute with fp32 gradient reduction under
    ``bf16_mixed``."""
    # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16_mixed"
        else MixedPrecisionPolicy()
    )
    units = [*transformer_blocks(model), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for unit in units:  # (per unit: these setters are not recursive)
        # the loss is already normalised by the global token count: sum the ranks' gradients,
        # with a plain SUM (gloo has neither AVG nor PREMUL_SUM), times 1.0
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class ShardedTrainer(Trainer):
    """A ``Trainer`` whose model is ``fully_shard``-ed over the default process group: its
    step trains this rank's share and merges the statistics (module docstring)."""

    def __init__(self, *args, rank: int, world_size: int, **kwargs) -> None:
        super().__init__(*args, trace=False, **kwargs)
        self.rank, self.world_size = rank, world_size
        # one forward and one backward per micro-batch on every rank (collectives in lockstep):
        # no shared-prompt forward (two), and no chunked log-probs (they read the output
        # projection's weight outside the root's forward, where it is still a shard)
        self._prefix_ok = False
        self.chunk = None

    def _accumulate_grads(self, rollouts, advantages, total_tokens, total_seqs, acc) -> None:
        shares = shard_rollouts(rollouts, self.world_size)
        counts = [len(self._slices([rollouts[i] for i in s])) if s else 0 for s in shares]
        mine = [rollouts[i] for i in shares[self.rank]]
        mine_adv = [advantages[i] for i in shares[self.rank]]
        if mine:
            super()._accumulate_grads(mine, mine_adv, total_tokens, total_seqs, acc)
        idle = self._micro_batch(rollouts[:1], [0.0])
        for _ in range(max(counts) - counts[self.rank]):
            self._idle_micro_step(idle)

    def _idle_micro_step(self, batch) -> None:
        """A forward and a backward that add nothing: this rank joins the others' collectives."""
        with prec.autocast(self.precision, self.device):
            logp, _ = token_logprobs(self.model, batch, self.temperature, self.chunk)
        (logp.float().sum() * 0.0).backward()

    def _clip_grads(self) -> torch.Tensor:
        norm = super()._clip_grads()  # of the whole gradient: a DTensor over the shards
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _finish_stats(self, acc: _Accumulator) -> dict[str, float]:
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, (acc.sums, acc.weights, acc.maxima, acc.plain_sums))
        merged = _Accumulator()
        for sums, weights, maxima, plain in parts:  # in rank order: the same sums everywhere
            for key, total in sums.items():
                merged.sums[key] = merged.sums.get(key, 0.0) + total
                merged.weights[key] = merged.weights.get(key, 0.0) + weights[key]
            for key, value in maxima.items():
                merged.max(key, value)
            merged.plain_sums |= plain
        return merged.finish()

    def _step_optimizer(self) -> tuple[float, float]:
        """The step, and the update's and weights' RMS over all ranks' shards."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        with torch.no_grad():
            before = torch._foreach_mul(local, 1.0)  # this rank's shards: 1/N of the model
            self.optimizer.step()
            torch._foreach_sub_(before, local)
            sums = torch.tensor(
                [
                    sum(float(n) ** 2 for n in torch._foreach_norm(before)),
                    sum(float(n) ** 2 for n in torch._foreach_norm(local)),
                    float(sum(t.numel() for t in local)),
                ],
                dtype=torch.float64,
                device=self.device,
            )
            del before
        dist.all_reduce(sums)
        update_sq, weight_sq, count = sums.tolist()
        return (update_sq / max(count, 1)) ** 0.5, (weight_sq / max(count, 1)) ** 0.5

    # -- state: full (gathered) tensors, in the single trainer's layout ----------------------

    def state_dict(self) -> dict:
        """The full state on rank 0 (on the CPU); empty model and optimizer entries elsewhere."""
        # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=options),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """From a sharded checkpoint's trainer state (each rank reads its shards, on any rank
        count) or a full state (every rank gets it and keeps its shards)."""
        if state.get("format") == SHARDED_FORMAT:
            load_trainer_state(self, state)
            return
        # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        apply_optimizer_config(self.optimizer, self.scheduler, self.cfg)
        self.version = int(state["version"])


class GatheredParams(Mapping):
    """``synced_params`` of a sharded model, each parameter gathered (``full_tensor()``, a
    collective every rank joins in the same order) when it is read: a reader must read each
    once, in order, as the byte lane's cast does (the other ranks read it so)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = dict(model.named_parameters())

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name].detach()
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class ShardedTrainerExecutor(TrainerExecutor):
    """One rank of the sharded trainer. Rank 0 holds the weight sender and writes
    checkpoints; every rank joins the gathers they need. Its model starts from the meta
    device where the model folder allows it (``loomrl.training.fsdp_init``): no rank holds
    the whole model."""

    def __init__(
        self,
        cfg: TrainerSetup,
        sender,
        owned_transport,
        rank: int,
        world_size: int,
        rendezvous: str,
        group_secret: str | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.group_secret = group_secret
        cfg = self._join_group(cfg, rendezvous)
        super().__init__(cfg, sender, owned_transport)

    def _load_model(self, cfg: TrainerSetup, device):
        """This rank's shards: from the meta device where the model folder allows it
        (``loomrl.training.fsdp_init``), else the whole model loaded, then sharded."""
        precision = prec.resolve_precision(cfg.trainer, device)
        shard = partial(
            shard_model,
            mesh=self.mesh,
            precision=precision,
            reshard=cfg.trainer.parallel.reshard_after_forward,
        )
        return start_sharded_model(cfg.model, prec.master_dtype(precision), shard, seed=cfg.seed)

    def _build_trainer(self, cfg: TrainerSetup, model, device) -> Trainer:
        return ShardedTrainer(
            model,
            self.tokenizer,
            cfg.algorithm,
            cfg.trainer,
            cfg.temperature,
            rank=self.rank,
            world_size=self.world_size,
            max_completion_tokens=cfg.max_new_tokens,
        )

    def _join_group(self, cfg: TrainerSetup, rendezvous: str) -> TrainerSetup:
        """Join the process group (NCCL with a GPU per rank on CUDA, else gloo) and build
        ``self.mesh``; ``cfg`` with this rank's device."""
        rank, world_size = self.rank, self.world_size
        if resolve_device(cfg.model.device).type == "cuda":  # a GPU per rank: cuda:<rank>
            visible = torch.cuda.device_count()  # (a Ray actor sees its own GPU only)
            if cfg.runtime == "process" and world_size > visible:
                raise ValueError(
                    f"trainer.parallel.dp_shard={world_size} on CUDA needs a GPU per rank (NCCL "
                    f"cannot put two ranks on one device); this node has {visible}"
                )
            torch.cuda.set_device(rank % visible)
            device = f"cuda:{torch.cuda.current_device()}"
            cfg = replace(cfg, model=cfg.model.model_copy(update={"device": device}))
            backend = "nccl"
        else:
            backend = "gloo"
        # a store of loomrl's own: on loopback where every rank is local, keys under the
        # job's secret (loomrl.runtime.group_store, docs/security.md)
        timeout = timedelta(seconds=cfg.trainer.parallel.collective_timeout_s)
        init_process_group(backend, rendezvous, rank, world_size, self.group_secret, timeout)

        self.mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world_size,))
        logger.info(
            "trainer rank %d of %d joined at %s (%s)", rank, world_size, rendezvous, backend
        )
        return cfg

    def publish(self, full: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        params = GatheredParams(self.trainer.model)
        if self.rank != 0:
            for _ in params.values():  # join each gather rank 0's publisher makes
                pass
            return {}
        if self.publisher.sender.carries_tensors:
            # the tensor lane reads the state more than once (sizes, then the pack): gather
            # it first, in the published dtype, as the lane's buffer will hold it
            dtype = self.publisher.dtype
            params = {name: tensor.to(dtype) for name, tensor in params.items()}
        metrics = self.publisher.publish(params, self.trainer.version, full=full)
        metrics["timing/publish_s"] = time.perf_counter() - t0
        return metrics

    def save_checkpoint(self, root: str, step: int, extra: dict, keep: int) -> str:
        """Every rank writes its shards; rank 0 the rest, and answers the folder's path."""
        path = save_sharded_checkpoint(self.trainer, Path(root), step, extra, keep)
        return "" if path is None else str(path)

    def save_pretrained(self, path: str) -> None:
        state = self.trainer.state_dict()["model"]  # gathered on rank 0
        if self.rank != 0:
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        self.trainer.model.save_pretrained(path, state_dict=state)
        self.tokenizer.save_pretrained(path)

    def offload(self) -> float:
        raise NotImplementedError(
            "trainer.parallel.type='fsdp2' cannot be time-sliced yet (scheduler offload)"
        )

    def close(self) -> None:
        super().close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_sharded_trainer(
    cfg: TrainerSetup,
    transport: TransportSpec | None,
    group_secret: str,
    rank: int,
    world_size: int,
    rendezvous: str,
) -> ShardedTrainerExecutor:
    """Rank ``rank`` of the sharded trainer; ``transport`` (rank 0's only) is the sending end
    of weight sync (module-level, so that a ``functools.partial`` of it pickles)."""
    sender = owned = None
    if transport is not None:
        opened, is_owned = open_transport(transport)
        sender, owned = opened.sender(), (opened if is_owned else None)
    return ShardedTrainerExecutor(
        cfg, sender, owned, rank, world_size, rendezvous, group_secret=group_secret
    )


def sharded_trainer_rank(
    cfg: TrainerSetup,
    transport: TransportSpec,
    group_secret: str,
    rank: int,
    world_size: int,
    rendezvous: str,
):
    """The ``rank_factory`` of ``start_group``: rank 0 gets the weight sender."""
    return partial(
        start_sharded_trainer,
        cfg,
        transport if rank == 0 else None,
        group_secret,
        rank,
        world_size,
        rendezvous,
    )


def start_trainer_group(
    runtime: Runtime, cfg: TrainerSetup, transport: TransportSpec
) -> ExecutorGroup:
    """``trainer.parallel.dp_shard`` ranks behind one trainer handle. The ranks share a
    fresh secret that hides their store's keys; it reaches them as the transport does (in
    the pickled factory), never in the rendezvous URL or the run folder."""
    group_secret = secrets.token_hex(32)
    return start_group(
        runtime,
        "trainer",
        partial(sharded_trainer_rank, cfg, transport, group_secret),
        cfg.trainer.parallel.dp_shard,
        TrainerEndpoints,
    )
