"""Hugging Face transformers generation engine.

A batched sampling loop over the model's forward pass with a KV cache. Sampling is a pure
function of (weights, prompt, sampling params, seed): each sequence draws its noise from its
own ``torch.Generator``, so a rollout does not depend on what it was batched with, and a
synchronous run is reproducible step by step on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from loomrl.device import module_device
from loomrl.device.offload import Swappable
from loomrl.generation.base import Generator, sample_grouped
from loomrl.generation.inflight import InflightUpdates, prompts_so_far, token_versions
from loomrl.generation.static_decode import StaticDecoder, static_decode_unsupported
from loomrl.generation.traced import KVForward
from loomrl.models.cache import can_repeat, probe_can_repeat, repeat_cache
from loomrl.models.quantize import quantize_linears
from loomrl.models.traces import ShapeTraces, can_trace
from loomrl.types import GenerationRequest, GenerationResult, SamplingParams
from loomrl.weights.lora import is_peft_model, load_adapter_state
from loomrl.weights.params import published_state
from loomrl.weights.publisher import DTYPES, Subscriber
from loomrl.weights.quantized import QuantizedPublish, is_codes, scale_name, weight_name
from loomrl.weights.receiver import WeightReceiver, WeightsApplied

logger = logging.getLogger(__name__)

# decode steps between "is every sequence done?" host syncs on a GPU
EOS_CHECK_EVERY_ACCELERATOR = 8


@dataclass
class _Decode:
    """A batch's decode state: the next token's logits, the KV cache (or the static step
    holding it), the attention mask, each row's next position and the cache slot the next
    step writes."""

    logits: torch.Tensor
    cache: Any
    attention: torch.Tensor | None
    next_pos: torch.Tensor
    static: Any
    slot: int


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens with mass >= top_p; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    outside = cumulative - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


class HFGenerator(Generator):
    """Generation with a transformers causal LM on the model's device, in the model's dtype.

    The forward computes in the model's dtype (bf16 weights: bf16 matmuls); sampling does
    not: logits are cast to fp32 before temperature, top-p and log-softmax, so the behaviour
    log-probs are fp32 whatever the weights are. The weights are those of the last
    ``WeightUpdate`` applied: the receiver's mirror in the published dtype is the base
    deltas apply to; the model's parameters are loaded from the tensors each update changed.

    Decoding (docs/engines.md): the prefill's ``DynamicCache`` grown a token at a time, by
    default; with ``static_cache`` a preallocated cache and a fixed-shape step
    (``loomrl.generation.static_decode``), replayed from a CUDA graph with ``cuda_graphs`` on
    a CUDA device. ``eos_check_every``: steps between host syncs that end the loop once every
    sequence is done (1 on the CPU, where a sync costs nothing; each one on a GPU stalls the
    launch queue, and the steps run past the last EOS are masked out, not reported).

    ``quantize`` ('int8', 'fp8'; ``loomrl.models.quantize``): the Linear layers hold quantized
    weights, re-quantized from the unquantized mirror after every update; no tracing then.
    With ``publish_quantized`` the trainer publishes their codes and scales
    (``loomrl.weights.quantized``): the mirror holds those, and the layers load them as they are.
    """

    # loomrl.device.offload.Swappable, made at the first offload
    _swap = None

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        subscriber: Subscriber | None = None,
        publish_dtype: str = "bfloat16",
        trace: bool = False,
        static_cache: bool = False,
        cuda_graphs: bool = False,
        eos_check_every: int | None = None,
        stop: list[str] | None = None,
        quantize: str = "none",
        publish_quantized: bool = False,
        inflight_every_tokens: int | None = None,
        partial_rollouts: bool = False,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        # Every EOS id: the tokenizer's and the generation config's (an int or a list; an
        # instruct model's lists its end-of-turn token there).
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._eos_tensor = (
            None
            if len(self.eos_ids) == 1
            else torch.tensor(sorted(self.eos_ids), device=module_device(model))
        )
        self.stop = list(stop or [])  # stop strings: completions are cut at the first (cut_at_stop)
        self.pad_id = tokenizer.pad_token_id
        self.device = module_device(model)
        mirror = published_state(model, DTYPES[publish_dtype])
        self.receiver = WeightReceiver(mirror, self.load_weights, subscriber)
        self.quantized = self._quantize(quantize, publish_quantized)
        self.share_prefill = True  # each distinct prompt's prefill once (off for non-HF caches)
        # forward passes from TorchScript traces (loomrl.models.traces)
        self.trace = trace and self.quantized is None
        self._traced: ShapeTraces | None = None
        self._static: StaticDecoder | None = self._static_decoder(
            static_cache or cuda_graphs, cuda_graphs
        )
        if eos_check_every is None:
            eos_check_every = 1 if self.device.type == "cpu" else EOS_CHECK_EVERY_ACCELERATOR
        if eos_check_every < 1:
            raise ValueError(f"eos_check_every must be >= 1, got {eos_check_every}")
        self.eos_check_every = eos_check_every
        # in-flight updates: a newer version applied between decode steps (None: between calls)
        self.inflight = InflightUpdates.every_tokens(inflight_every_tokens, partial_rollouts)

    def _static_decoder(self, static_cache: bool, cuda_graphs: bool) -> StaticDecoder | None:
        if not static_cache:
            return None
        why = "a PEFT model" if is_peft_model(self.model) else static_decode_unsupported(self.model)
        if why is not None:
            logger.info("generator decodes on a dynamic cache: no static cache for %s", why)
            return None
        return StaticDecoder(self.model, cuda_graphs=cuda_graphs and self.device.type == "cuda")

    def _quantize(self, kind: str, publish_quantized: bool = False):
        """The model's Linear layers quantized from the mirror (``generation.engine.quantize``), or
        None for full precision. The mirror stays unquantized: updates apply to it, and
        ``load_weights`` re-quantizes the layers each one changed; with ``publish_quantized``
        the mirror holds codes and scales instead, as the trainer publishes them."""
        if kind == "none":
            return None

        if is_peft_model(self.model):
            raise ValueError(
                f"generation.engine.quantize={kind!r} does not take a LoRA model (model.lora); use 'none'"
            )
        selected = QuantizedPublish.of_model(self.model, kind) if publish_quantized else None
        if selected is not None:  # codes and scales in the mirror, as the trainer publishes them
            weights = {n: self.mirror[n] for n in selected.names}  # all quantized: no dtype used
            self.mirror.update(selected.cast(weights, torch.float32))
        quantized = quantize_linears(self.model, kind)
        with torch.no_grad():
            for name in filter(quantized.owns, self.mirror):
                if selected is not None and name in selected.names:
                    codes, scales = self.mirror[name], self.mirror[scale_name(name)]
                    quantized.load_quantized(name.removesuffix(".weight"), codes, scales)
                else:
                    quantized.load(name, self.mirror[name])
        return quantized

    # -- weights -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.receiver.version

    @property
    def mirror(self) -> dict[str, torch.Tensor]:
        return self.receiver.mirror

    @property
    def weight_wait_timeout_s(self) -> float:
        return self.receiver.wait_timeout_s

    @weight_wait_timeout_s.setter
    def weight_wait_timeout_s(self, seconds: float) -> None:
        self.receiver.wait_timeout_s = seconds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if is_peft_model(self.model):
            load_adapter_state(self.model, dict(weights))
            return

        quantized, params = self.quantized, dict(self.model.named_parameters())
        published_codes = {}  # quantized weights published as codes + scales (publish_quantized)
        with torch.no_grad():
            for name, tensor in weights:
                weight = weight_name(name) if quantized is not None else None  # of scales
                if weight is not None and quantized.owns(weight):
                    published_codes[weight] = None
                elif quantized is not None and quantized.owns(name):
                    if name.endswith(".weight") and is_codes(tensor):
                        published_codes[name] = None
                    else:
                        quantized.load(name, tensor)  # re-quantized from the mirror
                else:
                    params[name].copy_(tensor)
        for name in published_codes:  # loaded as they are, once both are in the mirror
            codes, scales = self.mirror[name], self.mirror[scale_name(name)]
            quantized.load_quantized(name.removesuffix(".weight"), codes, scales)

    def update_weights(self, update) -> int:
        return self.receiver.apply(update)

    def apply_weights(self, min_version: int = 0) -> WeightsApplied:
        return self.receiver.apply_newest(min_version)

    # -- time-slicing (loomrl.scheduler): the state leaves the device while another job has it

    def offload(self) -> float:
        """Move the model and the weight mirror off the device; returns the seconds."""
        if self._swap is None:
            self._swap = Swappable(self.model, tensor_dicts=[self.mirror])
        if self._traced is not None:  # traces hold the tensors offload replaces
            self._traced.clear()
        if self._static is not None:  # so do the CUDA graphs (and the static caches hold memory)
            self._static.clear()
        return self._swap.offload()

    def restore(self) -> float:
        """Bring back what ``offload`` moved, bit for bit; returns the seconds it took."""
        return self._swap.restore() if self._swap is not None else 0.0

    def close(self) -> None:
        """Stop the receiver's background work (prefetch thread), if any."""
        self.receiver.close()

    # -- sampling ------------------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], apply_newest: bool = False
    ) -> list[GenerationResult]:
        applied = self._apply_for(requests, apply_newest)
        if not requests:
            return []
        if self.inflight is not None:
            self.inflight.call_apply_s = 0.0
        results = self._generate_grouped(requests)
        self._report_apply(results, applied)
        if self.inflight is not None and self.inflight.call_apply_s > 0:  # paused mid-request too
            results[0].weight_apply_s += self.inflight.call_apply_s
            if self.receiver.subscriber is not None:
                results[0].weight_metrics = self.receiver.subscriber.metrics()
        if self._traced is not None or self._static is not None or self.inflight is not None:
            metrics = self._traced.metrics("generation") if self._traced is not None else {}
            if self._static is not None:
                metrics.update(self._static.metrics("generation"))
            if self.inflight is not None:
                metrics.update(self.inflight.metrics("generation"))
            results[0].engine_metrics = metrics
        return results

    def _generate_grouped(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return sample_grouped(requests, self._sample, self.tokenizer, self.stop, self.version)

    @torch.no_grad()
    def _sample(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams
    ) -> tuple:
        """Token ids, log-probs and finish reasons per sequence; with in-flight updates also
        the version that sampled each token (``loomrl.generation.inflight``)."""
        uniforms = self._uniforms(seeds, sampling.max_new_tokens)  # [max_new_tokens, n]
        if self.trace and self._traced is None:
            self._start_tracing()
        decode = self._start_decode(prompts, sampling.max_new_tokens)
        step_tokens, step_logprobs, step_live, step_versions = [], [], [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        for step in range(sampling.max_new_tokens):
            chosen, chosen_logp = self._pick(decode.logits, uniforms[step], sampling)
            step_tokens.append(chosen)
            step_logprobs.append(chosen_logp)
            step_live.append(~done)
            step_versions.append(self.version)  # of the forward that made these logits
            done = done | (
                chosen == self.eos_id
                if self._eos_tensor is None
                else torch.isin(chosen, self._eos_tensor)
            )
            if self.stop and (step + 1) % self.eos_check_every == 0:
                done = done | self._holds_stop(step_tokens, done)
            if step == sampling.max_new_tokens - 1:  # no forward for a token never sampled
                break
            if (step + 1) % self.eos_check_every == 0 and bool(done.all()):  # (a host sync)
                break
            # between two decode steps: a newer version, if any, lands here and only here
            if self.inflight is not None and self.inflight.due(step):
                if self.inflight.look(self.receiver) and self.inflight.recompute:
                    remaining = sampling.max_new_tokens - step - 1
                    decode = self._start_decode(  # cut: continued as prompt + tokens so far
                        prompts_so_far(prompts, step_tokens, step_live), remaining
                    )
                    continue
            self._decode_step(decode, chosen.masked_fill(done, self.pad_id).unsqueeze(1))
        ids, lps, finish = self._completions(step_tokens, step_logprobs, step_live)
        if self.inflight is None:
            return ids, lps, finish
        return ids, lps, finish, token_versions(step_versions, ids)

    def _start_decode(self, prompts: list[list[int]], max_new_tokens: int) -> _Decode:
        """The prompts prefilled: the first token's logits and the state the steps advance."""
        logits, cache, attention, positions = self._prefill(prompts)
        static = self._start_static(cache, attention, max_new_tokens)
        return _Decode(logits, cache, attention, positions[:, -1] + 1, static, positions.shape[1])

    def _decode_step(self, decode: _Decode, step_ids: torch.Tensor) -> None:
        """One forward over the step's tokens: ``decode`` holds the next token's logits."""
        if decode.static is not None:
            decode.logits = decode.static.run(step_ids, decode.next_pos.unsqueeze(1), decode.slot)
        else:
            if decode.attention is not None:
                ones = torch.ones((step_ids.shape[0], 1), dtype=torch.long, device=self.device)
                decode.attention = torch.cat([decode.attention, ones], dim=1)
            decode.logits, decode.cache = self._forward(
                step_ids, decode.attention, decode.next_pos.unsqueeze(1), decode.cache
            )
        decode.next_pos = decode.next_pos + 1
        decode.slot += 1

    def _holds_stop(self, step_tokens: list[torch.Tensor], done: torch.Tensor) -> torch.Tensor:
        """[sequences] bool: live sequences whose last tokens hold a stop string (they stop
        here; ``cut_at_stop`` cuts them exactly afterwards). The window covers the longest
        stop string and the steps since the last look (a token is at least one character)."""
        window = max(map(len, self.stop)) + self.eos_check_every
        tails = self.tokenizer.batch_decode(
            torch.stack(step_tokens[-window:], dim=1).tolist(), skip_special_tokens=True
        )
        live = (~done).tolist()
        hits = [alive and any(s in text for s in self.stop) for alive, text in zip(live, tails)]
        return torch.tensor(hits, dtype=torch.bool, device=self.device)

    def _uniforms(self, seeds: list[int], steps: int) -> torch.Tensor:
        """[steps, sequences] uniforms on the device, each sequence's from its own seed, drawn
        on the CPU (one generator, reseeded per sequence: the same numbers as a fresh one, a
        third cheaper)."""
        rng, draws = torch.Generator(), []
        for s in seeds:
            rng.manual_seed(s % (2**63))
            draws.append(torch.rand(steps, generator=rng, dtype=torch.float64))
        return torch.stack(draws, dim=1).to(self.device)

    def _start_static(self, cache, attention, max_new_tokens: int):
        """The static-cache decode step loaded with the prompts' cache, or None for the
        dynamic-cache loop (``static_cache`` off, or a cache it cannot take)."""
        if self._static is None:
            return None
        if isinstance(cache, tuple):  # the traced forward's flat cache
            keys, values = list(cache[0::2]), list(cache[1::2])
        elif can_repeat(cache):
            keys, values = (
                [layer.keys for layer in cache.layers],
                [layer.values for layer in cache.layers],
            )
        else:
            logger.info(
                "generator decodes on a dynamic cache: its prefill cache is not plain full attention"
            )
            self._static = None
            return None
        return self._static.start(keys, values, attention, max_new_tokens)

    def _prefill(self, prompts: list[list[int]]):
        """The forward over the prompts, left-padded, each distinct prompt once (a request's
        samples share it, through a repeated KV cache): last-position logits, KV cache,
        attention mask (None when no row is padded) and positions, one row per entry of ``prompts``."""
        index: dict[tuple[int, ...], int] = {}
        owner = torch.tensor(
            [index.setdefault(tuple(p), len(index)) for p in prompts], device=self.device
        )
        shared = self.share_prefill and len(index) < len(prompts)
        rows = list(index) if shared else prompts
        width = max(len(p) for p in rows)
        input_ids = torch.full(
            (len(rows), width), self.pad_id, dtype=torch.long, device=self.device
        )
        attention = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for row, p in enumerate(rows):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        # No row padded: no mask at all (eager transformers skips an all-ones one; a trace
        # would build it, and attend through it, every step).
        if bool(attention.all()):
            attention = None
        logits, cache = self._forward(input_ids, attention, positions, None)
        if shared:
            if isinstance(cache, tuple):  # the traced forward's flat cache
                cache = tuple(t.index_select(0, owner) for t in cache)
            elif can_repeat(cache):
                cache = repeat_cache(cache, owner)
            else:  # sliding-window, linear-attention or a custom cache: no sharing
                self.share_prefill = False
                return self._prefill(prompts)
            logits, positions = logits.index_select(0, owner), positions.index_select(0, owner)
            attention = attention.index_select(0, owner) if attention is not None else None
        return logits, cache, attention, positions

    def _start_tracing(self) -> None:
        """Traces only where ``KVForward`` rebuilds the model's own cache faithfully."""
        if not can_trace(self.model) or not probe_can_repeat(self.model):
            logger.info(
                "generator forward runs eager: tracing needs a plain model with a full-attention DynamicCache"
            )
            self.trace = False
            return
        self._traced = ShapeTraces(
            KVForward(self.model), what="generator's forward", params_as_constants=True
        )

    def _forward(self, input_ids, attention, positions, cache):
        """Last-position logits (fp32) and the new cache: a flat tuple from the traced
        forward, the model's own cache object otherwise."""
        if self._traced is not None:  # (a trace takes tensors only: no mask is a mask of width 0)
            mask = (
                attention if attention is not None else input_ids.new_empty((input_ids.shape[0], 0))
            )
            out = self._traced(input_ids, mask, positions, *(cache or ()))
            return out[0], out[1:]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1, :].float(), out.past_key_values

    def _completions(
        self, tokens: list, logprobs: list, live: list
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Per-sequence token lists, log-probs and finish reasons from per-step tensors, up
        to and including EOS."""
        lengths = torch.stack(live, dim=1).sum(dim=1).tolist()  # tokens kept per sequence
        all_tokens = torch.stack(tokens, dim=1).tolist()
        all_logprobs = torch.stack(logprobs, dim=1).tolist()
        ids, lps, finish = [], [], []
        for row_tokens, row_logprobs, length in zip(all_tokens, all_logprobs, lengths):
            t = row_tokens[:length]
            ids.append(t)
            lps.append(row_logprobs[:length])
            finish.append("stop" if t and t[-1] in self.eos_ids else "length")
        return ids, lps, finish

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


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS id and every one of the model's ``generation_config.eos_token_id``."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(i) for i in configured)
    return ids
