"""The trainer executor: advantages, off-policy-corrected loss, AdamW on fp32 masters
(or bf16 ones, ``trainer.precision``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from loomrl.algorithms import group_advantages, kl_penalty, policy_loss_with_stats
from loomrl.config_common import AlgorithmConfig
from loomrl.device import module_device
from loomrl.models.cache import probe_can_repeat
from loomrl.models.traces import ShapeTraces, can_trace
from loomrl.training import precision as prec
from loomrl.training.chunked import chunked_logprobs, final_hidden, output_weight
from loomrl.training.config import TrainerConfig
from loomrl.training.optim_state import apply_optimizer_config
from loomrl.training.overlong import mask_truncated, reward_penalty
from loomrl.training.prefix import (
    PrefixBatch,
    build_prefix_batch,
    padded_tensor,
    prefix_logits,
    same_version_mask,
)
from loomrl.training.step_stats import _Accumulator, add_micro_batch_stats, step_and_measure
from loomrl.types import Group, Rollout

logger = logging.getLogger(__name__)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [batch, seq] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [batch, seq]
    target_mask: torch.Tensor  # [batch, seq-1] 1 where the next token is a trained completion token
    behaviour: torch.Tensor  # [batch, seq-1] behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [batch]
    same_version: torch.Tensor  # [batch] or [batch, seq-1] bool: sampled at the trainer's version

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.target_mask,
                    self.behaviour,
                    self.advantages,
                    self.same_version,
                )
            )
        )


def build_token_batch(
    rollouts: list[Rollout], advantages: list[float], version: int, pad_id: int
) -> TokenBatch:
    ids = [r.prompt_ids + r.completion_ids for r in rollouts]
    width = max(map(len, ids))
    # Logits at position p predict token p + 1: a completion's targets start one before it.
    shift = [[0.0] * (len(r.prompt_ids) - 1) for r in rollouts]
    return TokenBatch(
        padded_tensor(ids, width, pad_id, torch.long),
        padded_tensor([[1] * len(row) for row in ids], width, 0, torch.long),
        padded_tensor(
            [a + r.loss_mask for a, r in zip(shift, rollouts)], width - 1, 0.0, torch.float32
        ),
        padded_tensor(
            [a + r.behaviour_logprobs for a, r in zip(shift, rollouts)],
            width - 1,
            0.0,
            torch.float32,
        ),
        torch.tensor(advantages, dtype=torch.float32),
        same_version_mask(rollouts, version, width - 1, list(map(len, shift))),
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch | PrefixBatch,
    temperature: float,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token and the entropy of each prediction, in fp32, aligned
    with ``batch.target_mask``: ``[batch, seq-1]`` for a ``TokenBatch``, ``[batch,
    completion]`` for a ``PrefixBatch`` (each prompt computed once). ``chunk``: from the
    final hidden states ``chunk`` tokens at a time (``loomrl.training.chunked``), where the
    model's output projection is a plain ``Linear``; None: the full log-softmax."""
    weight = output_weight(model) if chunk is not None else None
    if weight is not None:
        if isinstance(batch, PrefixBatch):
            hidden, targets = prefix_logits(model, batch, hidden=True), batch.suffix_ids
        else:
            out = final_hidden(
                model,
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                use_cache=False,
            )
            hidden, targets = out.last_hidden_state[:, :-1], batch.input_ids[:, 1:]
        return chunked_logprobs(hidden, weight, targets, temperature, chunk)
    if isinstance(batch, PrefixBatch):
        logits = prefix_logits(model, batch).float() / temperature
        targets = batch.suffix_ids.unsqueeze(-1)
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1, :].float() / temperature
        targets = batch.input_ids[:, 1:].unsqueeze(-1)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class Logprobs(torch.nn.Module):
    """``token_logprobs`` over a batch's tensors (a ``PrefixBatch``'s six inputs, or a
    ``TokenBatch``'s ids and mask), so that it can run from traces."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(tensors) == 2:
            batch = TokenBatch(tensors[0], tensors[1], *([None] * 4))
        else:
            batch = PrefixBatch(*tensors, *([None] * 4))
        return token_logprobs(self.model, batch, self.temperature)

    @staticmethod
    def inputs(batch: TokenBatch | PrefixBatch) -> tuple[torch.Tensor, ...]:
        if isinstance(batch, PrefixBatch):
            return (
                batch.prefix_ids,
                batch.prefix_attn,
                batch.prefix_len,
                batch.owner,
                batch.suffix_ids,
                batch.suffix_attn,
            )
        return batch.input_ids, batch.attention_mask


def compute_advantages(
    groups: list[Group], scale: str, penalty: Callable[[Rollout], float] | None = None
) -> tuple[list[Rollout], list[float]]:
    """Advantages within each group over its successfully scored rollouts. Groups with as
    many of those are one tensor, one row each: the same numbers as a group at a time.
    ``penalty``: added to each rollout's reward first (``algorithm.overlong='soft'``)."""
    kept = [group.ok_rollouts() for group in groups]
    by_size: dict[int, list[int]] = {}
    for i, ok in enumerate(kept):
        if ok:
            by_size.setdefault(len(ok), []).append(i)
    per_group: list[list[float]] = [[] for _ in kept]
    for size, members in by_size.items():
        if size == 1:  # a lone rollout has nothing to be compared with
            for i in members:
                per_group[i] = [0.0]
            continue
        if penalty is None:
            rewards = torch.tensor([[float(r.reward) for r in kept[i]] for i in members])
        else:
            rewards = torch.tensor([[r.reward + penalty(r) for r in kept[i]] for i in members])
        for i, row in zip(members, group_advantages(rewards, scale=scale).tolist()):
            per_group[i] = row
    return list(chain.from_iterable(kept)), list(chain.from_iterable(per_group))


def micro_batch_slices(
    rollouts: list[Rollout], max_rows: int, max_tokens: int | None
) -> list[slice]:
    """Consecutive micro-batches of at most ``max_rows`` rollouts and, with ``max_tokens``,
    at most that many padded tokens (rows x the longest prompt + completion); a rollout
    longer than ``max_tokens`` is a micro-batch of its own."""
    slices, start, width = [], 0, 0
    for i, r in enumerate(rollouts):
        length = len(r.prompt_ids) + len(r.completion_ids)
        rows = i - start
        if rows and (
            rows >= max_rows
            or (max_tokens is not None and max(width, length) * (rows + 1) > max_tokens)
        ):
            slices.append(slice(start, i))
            start, width = i, 0
        width = max(width, length)
    slices.append(slice(start, len(rollouts)))
    return slices


def lr_factor(cfg: TrainerConfig):
    """Multiplier of the base learning rate at a step: linear warmup, then the schedule.

    Run by ``torch.optim.lr_scheduler.LambdaLR``. Not ``transformers.get_scheduler``: its
    warmup starts at 0, so the first RL step (a whole generation round) would not move the
    weights, and its linear decay rounds differently; torch's chained LinearLR/SequentialLR
    compute the factor recursively. Either would change trained numbers on the same seed."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """Holds the policy (fp32 masters, or bf16 under ``trainer.precision='bf16'``), AdamW,
    and an optional frozen reference for the KL penalty."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        algorithm: AlgorithmConfig,
        trainer: TrainerConfig,
        temperature: float,
        *,
        trace: bool | None = None,
        reference_dtype: torch.dtype | None = None,
        max_completion_tokens: int | None = None,
    ) -> None:
        """``trace``: the training forward from traces; by default ``trainer.trace``, where
        'auto' is off (a trainer on its own shares its process with no other executor).
        ``reference_dtype``: of the KL reference (the job's ``resolve_dtype(model)``); by
        default the precision's compute dtype. ``max_completion_tokens``: the completions'
        maximum length (``generation.max_new_tokens``), the constant of ``dr_grpo`` and the
        end of ``overlong='soft'``'s ramp."""
        self.device = module_device(model)
        self.precision = prec.resolve_precision(trainer, self.device)
        self.model = model.to(prec.master_dtype(self.precision)).train()
        prec.allow_tf32(trainer, self.device)
        if trainer.gradient_checkpointing:
            prec.enable_gradient_checkpointing(self.model)
        self.chunk = prec.chunk_tokens(trainer, self.precision, self.device)
        if self.chunk is not None and output_weight(self.model) is None:
            logger.info(
                "trainer.chunked_logprobs: the output projection is not a plain Linear; full log-softmax"
            )
            self.chunk = None
        self.pad_id = tokenizer.pad_token_id
        self.algo = algorithm
        self._set_lengths(max_completion_tokens)
        self.cfg = trainer
        self.temperature = temperature
        self.version = 0
        self._phase_s = {"forward": 0.0, "backward": 0.0}  # of the step in progress
        # can rows share their prompt's forward (trainer.shared_prefix); checkpointed layers keep no cache
        self._prefix_ok: bool | None = False if trainer.gradient_checkpointing else None
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(trainer))
        self.traces = self._build_traces(trainer.trace is True if trace is None else trace)
        self.reference = None
        # frozen, in the compute dtype: no second fp32 copy where bf16 does
        if algorithm.kl_coef > 0:
            dtype = reference_dtype or prec.compute_dtype(self.precision)
            self.reference = prec.frozen_copy(self.model, dtype)

    def _set_lengths(self, max_completion_tokens: int | None) -> None:
        """What the objective reads from the completions' maximum length: ``dr_grpo``'s
        divisor and ``overlong='soft'``'s penalty."""
        self.max_completion_tokens = max_completion_tokens
        if self.algo.loss == "dr_grpo" and not max_completion_tokens:
            raise ValueError(
                "algorithm.loss='dr_grpo' divides by the completions' maximum length "
                "(generation.max_new_tokens): the trainer needs max_completion_tokens"
            )
        self._penalty = reward_penalty(self.algo, max_completion_tokens)

    def _build_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the trainable parameters. Fused where torch has the kernel: it also
        holds the GIL for one call, not one per tensor, which matters when a generator
        thread shares it (runtime = "local")."""
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = True if cfg.fused_optimizer and self.device.type in ("cpu", "cuda") else None
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused
        )

    def _build_traces(self, wanted: bool) -> ShapeTraces | None:
        """The training forward from traces (loomrl.models.traces): no GIL held while it
        runs. fp32 only: a trace would freeze autocast's choices, and the chunked path's own
        backward."""
        if wanted and can_trace(self.model) and self.chunk is None and self.precision == "fp32":
            return ShapeTraces(Logprobs(self.model, self.temperature), what="trainer's forward")
        return None

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on ``groups``; the version grows by one."""
        t0 = time.perf_counter()
        rollouts, advantages = compute_advantages(groups, self.algo.advantage_scale, self._penalty)
        if not rollouts:
            raise ValueError("train_step got no successfully scored rollout")
        overlong = self._overlong(rollouts)
        if self.algo.overlong == "filter":
            rollouts, _ = mask_truncated(rollouts)
        batch_stats = _Accumulator()
        self._phase_s = {"forward": 0.0, "backward": 0.0}
        total_tokens = sum(sum(r.loss_mask) for r in rollouts)
        total_seqs = sum(1 for r in rollouts if sum(r.loss_mask) > 0)
        self._step_rows = len(rollouts)
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulate_grads(rollouts, advantages, total_tokens, total_seqs, batch_stats)
        grad_norm = self._clip_grads()
        metrics = self._finish_stats(batch_stats)
        if not (math.isfinite(metrics["train/loss"]) and math.isfinite(float(grad_norm))):
            # Checked before stepping, so neither the weights nor AdamW's moments see a NaN.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite loss {metrics['train/loss']} or grad norm {float(grad_norm)} at version "
                f"{self.version}; the step was not applied (check rewards and the learning rate)"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        t_opt = time.perf_counter()
        update_rms, weight_rms = self._step_optimizer()
        optimizer_s = time.perf_counter() - t_opt
        self.scheduler.step()
        self.version += 1
        metrics["train/lr"] = lr
        metrics.update(
            {
                "train/grad_norm": float(grad_norm),
                "train/update_rms": update_rms,
                "train/update_to_weight": update_rms / max(weight_rms, 1e-12),
                "train/num_rollouts": float(len(rollouts)),
                "train/num_tokens": float(total_tokens),
                "train/advantage_abs_mean": sum(abs(a) for a in advantages) / len(advantages),
                "timing/train_step_s": time.perf_counter() - t0,
                "timing/train_forward_s": self._phase_s["forward"],
                "timing/train_backward_s": self._phase_s["backward"],
                "timing/train_optimizer_s": optimizer_s,
            }
        )
        metrics.update(overlong)
        if self.traces is not None:
            metrics.update(self.traces.metrics("train"))
        return metrics

    def _overlong(self, rollouts: list[Rollout]) -> dict[str, float]:
        """``algorithm.overlong``'s statistics of the step: the share of completions cut at
        the limit and, under 'soft', the mean penalty added to their rewards."""
        if self.algo.overlong == "none":
            return {}
        cut = sum(1 for r in rollouts if r.finish_reason == "length")
        metrics = {"train/truncated_frac": cut / len(rollouts)}
        if self._penalty is not None:
            penalties = [self._penalty(r) for r in rollouts]
            metrics["train/overlong_penalty_mean"] = sum(penalties) / len(penalties)
        return metrics

    # -- the step's parts a sharded trainer (loomrl.training.fsdp) replaces ----------------

    def _accumulate_grads(
        self,
        rollouts: list[Rollout],
        advantages: list[float],
        total_tokens: int,
        total_seqs: int,
        acc: _Accumulator,
    ) -> None:
        """Forward and backward over ``rollouts`` a micro-batch at a time, the loss of each
        weighted by its share of ``total_tokens`` (or ``total_seqs``): the step's gradients."""
        for rows in micro_batch_slices(
            rollouts, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch
        ):
            micro = self._micro_batch(rollouts[rows], advantages[rows])
            self._micro_step(micro, total_tokens, total_seqs, acc)

    def _clip_grads(self) -> torch.Tensor:
        """Clip the gradients to ``max_grad_norm``; their norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    def _finish_stats(self, acc: _Accumulator) -> dict[str, float]:
        """The step's ``train/*`` statistics from the micro-batches'."""
        return acc.finish()

    def _step_optimizer(self) -> tuple[float, float]:
        """The optimizer step; the RMS of the update and of the weights after it."""
        return step_and_measure(self.optimizer)

    def _micro_batch(
        self, rollouts: list[Rollout], advantages: list[float]
    ) -> TokenBatch | PrefixBatch:
        """Rows sharing a prompt share its forward (``trainer.shared_prefix``) when any do."""
        if self._prefix_ok is None:  # decided once, from the model's own cache
            # 'auto' is on here (the sharded trainer decides it off before any batch)
            wanted = self.cfg.shared_prefix is not False
            self._prefix_ok = wanted and probe_can_repeat(self.model)
            if wanted and not self._prefix_ok:
                logger.info(
                    "trainer.shared_prefix: this model's KV cache cannot be shared (sliding-window, "
                    "linear-attention or custom layers); every row runs its own prompt"
                )
        if self._prefix_ok and len({tuple(r.prompt_ids) for r in rollouts}) < len(rollouts):
            return build_prefix_batch(rollouts, advantages, self.version, self.pad_id).to(
                self.device
            )
        return build_token_batch(rollouts, advantages, self.version, self.pad_id).to(self.device)

    def _micro_step(
        self, batch: TokenBatch | PrefixBatch, total_tokens: int, total_seqs: int, acc: _Accumulator
    ) -> None:
        """Forward and backward of one micro-batch, its loss weighted by its share of the
        step's tokens (or sequences); its statistics into ``acc``."""
        t0 = time.perf_counter()
        logp, entropy = self._logprobs(batch)
        mask = batch.target_mask
        loss, stats = policy_loss_with_stats(
            self.algo.loss,
            logp,
            batch.behaviour,
            batch.advantages,
            mask,
            clip_eps=self.algo.clip_eps,
            clip_eps_low=self.algo.clip_eps_low,
            clip_eps_high=self.algo.clip_eps_high,
            delta=self.algo.delta,
            aggregation=self.algo.aggregation,
            length_divisor=self.max_completion_tokens,
        )
        n_tokens = float(mask.sum())
        if self.algo.loss == "dr_grpo":
            # the micro-batch's share of the step's rows: sum / (rows x L) over the step
            weight = mask.shape[0] / self._step_rows
        elif self.algo.aggregation == "token":
            weight = n_tokens / max(total_tokens, 1)
        else:
            weight = float((mask.sum(1) > 0).sum()) / max(total_seqs, 1)
        total = loss * weight
        if self.reference is not None:
            with torch.no_grad(), prec.autocast(self.precision, self.device):
                ref_logp, _ = token_logprobs(self.reference, batch, self.temperature, self.chunk)
            kl = kl_penalty(logp, ref_logp.float(), mask)
            total = total + self.algo.kl_coef * kl * weight
            acc.add("train/kl", float(kl.detach()), n_tokens)
        t1 = time.perf_counter()
        total.backward()
        self._phase_s["forward"] += t1 - t0
        self._phase_s["backward"] += time.perf_counter() - t1
        add_micro_batch_stats(acc, batch, logp, entropy, loss, stats, weight, self.algo.delta)

    def _logprobs(self, batch: TokenBatch | PrefixBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's token log-probs and entropies (fp32), from traces when there are."""
        if self.traces is not None:
            logp, entropy = self.traces(*Logprobs.inputs(batch))
        else:
            with prec.autocast(self.precision, self.device):
                logp, entropy = token_logprobs(self.model, batch, self.temperature, self.chunk)
        return logp.float(), entropy.float()  # no-ops but for the full path in bf16

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") == "dcp":  # a sharded trainer's checkpoint (training/dcp.py)
            # lazy: torch.distributed.checkpoint loads only for a sharded checkpoint
            from loomrl.training.dcp import load_trainer_state

            return load_trainer_state(self, state)
        self.model.load_state_dict(state["model"])
        if "world_size" in state:  # a sharded trainer's (loomrl.training.fsdp): keyed by name
            # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], options=options
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_optimizer_config(self.optimizer, self.scheduler, self.cfg)
        self.version = int(state["version"])
