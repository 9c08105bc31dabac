"""Hugging Face transformers generation engine.

A batched sampling loop over the model's forward pass with a KV cache. Sampling is a pure
function of (weights, prompt, sampling params, seed): each sequence draws its noise from its
own ``torch.Generator``, so a rollout does not depend on what it was batched with, and a
synchronous run is reproducible step by step on CPU.
"""

from __future__ import annotations

import logging
import time

import torch

from loomrl.generation.base import Generator
from loomrl.models.cache import repeat_cache
from loomrl.types import Completion, GenerationRequest, GenerationResult, SamplingParams
from loomrl.weights.publisher import DTYPES, Subscriber

logger = logging.getLogger(__name__)


def synced_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors weight sync carries, detached and sharing storage with the model: every
    parameter (tied weights once), or for a PEFT model only the adapter, all that changes."""
    from loomrl.weights.lora import adapter_state, is_peft_model

    if is_peft_model(model):
        return adapter_state(model)
    return {name: p.detach() for name, p in model.named_parameters()}


def published_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of ``synced_params`` in the published dtype."""
    return {name: t.to(dtype).clone() for name, t in synced_params(model).items()}


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens with mass >= top_p; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    outside = cumulative - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


class HFGenerator(Generator):
    """Generation with a transformers causal LM, computing in fp32 on the CPU.

    The weights are those of the last ``WeightUpdate`` applied: a mirror in the published
    dtype is the base deltas apply to; the model's fp32 parameters are copied from it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        subscriber: Subscriber | None = None,
        publish_dtype: str = "bfloat16",
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.subscriber = subscriber
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self.mirror = published_state(model, DTYPES[publish_dtype])
        self.version = -1  # no version applied yet; the trainer publishes version 0 first
        self.num_updates_applied = 0
        self.weight_wait_timeout_s = 300.0  # how long a request waits for its min_version
        self.share_prefill = True  # each distinct prompt's prefill once (off for non-HF caches)

    # -- weights -------------------------------------------------------------------------

    def _load_mirror(self) -> None:
        from loomrl.weights.lora import is_peft_model, load_adapter_state

        if is_peft_model(self.model):
            load_adapter_state(self.model, self.mirror)
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.mirror[name])

    def _adopt(self, version: int) -> int:
        """The mirror now holds ``version``: copy it into the model's compute weights."""
        self._load_mirror()
        self.version = version
        self.num_updates_applied += 1
        return version

    def update_weights(self, update) -> int:
        from loomrl.weights import apply_update

        apply_update(self.mirror, update)
        return self._adopt(update.version)

    def sync_weights(self) -> int:
        """Apply whatever the subscriber has (between requests); returns the version."""
        if self.subscriber is None:
            return self.version
        update, _ = self.subscriber.poll(self.mirror, self.version if self.version >= 0 else None)
        return self._adopt(update.version) if update is not None else self.version

    def wait_for_version(self, needed: int) -> int:
        """Apply updates until this generator holds at least ``needed`` (a prefetched or
        torch_dist update may land a moment after the trainer's publish returned)."""
        deadline = time.monotonic() + self.weight_wait_timeout_s
        self.sync_weights()
        while self.version < needed and self.subscriber is not None:  # none: weights come by hand
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"generator at version {self.version} waited {self.weight_wait_timeout_s:g} s for version "
                    f"{needed} and it never arrived; check the weight transport and the trainer's log"
                )
            time.sleep(0.001)
            self.sync_weights()
        return self.version

    # -- time-slicing (loomrl.scheduler): the state leaves the device while another job has it

    def offload(self) -> float:
        """Move the model and the weight mirror off the device; returns the seconds."""
        if getattr(self, "_swap", None) is None:
            from loomrl.scheduler.offload import Swappable

            self._swap = Swappable(self.model, tensor_dicts=[self.mirror])
        return self._swap.offload()

    def restore(self) -> float:
        """Bring back what ``offload`` moved, bit for bit; returns the seconds it took."""
        return self._swap.restore() if getattr(self, "_swap", None) is not None else 0.0

    def close(self) -> None:
        """Stop the subscriber's background work (prefetch thread), if any."""
        if self.subscriber is not None:
            self.subscriber.close()

    # -- sampling ------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        applied_before = self.num_updates_applied
        t0 = time.perf_counter()
        self.wait_for_version(max((r.min_version for r in requests), default=0))
        apply_s = time.perf_counter() - t0 if self.num_updates_applied > applied_before else 0.0
        if not requests:
            return []
        by_params: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            s = req.sampling
            by_params.setdefault((s.temperature, s.top_p, s.max_new_tokens, s.greedy), []).append(i)
        results: list[GenerationResult | None] = [None] * len(requests)
        for indices in by_params.values():
            sampling = requests[indices[0]].sampling
            prompts, seeds, owners = [], [], []
            for i in indices:
                for k in range(requests[i].num_samples):
                    prompts.append(requests[i].prompt_ids)
                    seeds.append(requests[i].seed * 1_000_003 + k)
                    owners.append(i)
            completions = self._sample(prompts, seeds, sampling)
            for i in indices:
                results[i] = GenerationResult([], self.version)
            for owner, completion in zip(owners, completions):
                results[owner].completions.append(completion)
        results[0].weight_apply_s = apply_s
        if self.subscriber is not None:
            results[0].weight_metrics = self.subscriber.metrics()
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _sample(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        n = len(prompts)
        # Each sequence's uniforms come from its own generator, drawn once for all steps.
        uniforms = torch.stack([
            torch.rand(sampling.max_new_tokens, generator=torch.Generator().manual_seed(s % (2**63)),
                       dtype=torch.float64)
            for s in seeds
        ], dim=1)  # [max_new_tokens, n]
        logits, cache, attention, positions = self._prefill(prompts)
        step_tokens, step_logprobs, step_live = [], [], []
        done = torch.zeros(n, dtype=torch.bool)
        next_pos = positions[:, -1] + 1
        for step in range(sampling.max_new_tokens):
            chosen, chosen_logp = self._pick(logits, uniforms[step], sampling)
            step_tokens.append(chosen)
            step_logprobs.append(chosen_logp)
            step_live.append(~done)
            done = done | (chosen == self.eos_id)
            if bool(done.all()) or step == sampling.max_new_tokens - 1:  # no forward for a token never sampled
                break
            step_ids = chosen.masked_fill(done, self.pad_id).unsqueeze(1)
            attention = torch.cat([attention, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=next_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
            )
            logits, cache = out.logits[:, -1, :].float(), out.past_key_values
            next_pos = next_pos + 1
        return self._completions(step_tokens, step_logprobs, step_live)

    def _prefill(self, prompts: list[list[int]]):
        """The forward over the prompts, left-padded, each distinct prompt once (a request's
        samples share it, through a repeated KV cache): last-position logits, KV cache,
        attention mask and positions, one row per entry of ``prompts``."""
        from transformers.cache_utils import Cache

        index: dict[tuple[int, ...], int] = {}
        owner = torch.tensor([index.setdefault(tuple(p), len(index)) for p in prompts])
        shared = self.share_prefill and len(index) < len(prompts)
        rows = list(index) if shared else prompts
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for row, p in enumerate(rows):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        logits, cache = out.logits[:, -1, :].float(), out.past_key_values
        if shared:
            if not isinstance(cache, Cache):  # a model with its own cache type: no sharing
                self.share_prefill = False
                return self._prefill(prompts)
            logits, cache = logits.index_select(0, owner), repeat_cache(cache, owner)
            attention, positions = attention.index_select(0, owner), positions.index_select(0, owner)
        return logits, cache, attention, positions

    def _completions(self, tokens: list, logprobs: list, live: list) -> list[Completion]:
        """Per-sequence token lists from per-step tensors, up to and including EOS."""
        lengths = torch.stack(live, dim=1).sum(dim=1).tolist()  # tokens kept per sequence
        all_tokens = torch.stack(tokens, dim=1).tolist()
        all_logprobs = torch.stack(logprobs, dim=1).tolist()
        result = []
        for row_tokens, row_logprobs, length in zip(all_tokens, all_logprobs, lengths):
            t = row_tokens[:length]
            result.append(Completion(t, row_logprobs[:length], "stop" if t and t[-1] == self.eos_id else "length"))
        return result

    @staticmethod
    def _pick(
        logits: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row, and its log-prob under log_softmax(logits / temperature)."""
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        if sampling.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            probs = logp.exp()
            if sampling.top_p < 1.0:
                probs = _top_p_filter(probs, sampling.top_p)
            cdf = probs.double().cumsum(dim=-1)
            cdf = cdf / cdf[:, -1:]
            chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1)).squeeze(1)
            chosen = chosen.clamp(max=logits.shape[-1] - 1)
        return chosen, logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
