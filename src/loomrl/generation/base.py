"""The Generator interface: batched sampling that reports behaviour log-probs and version.

Its ``@endpoint`` methods are what the controller calls on a generator's handle. Weights
arrive through a ``loomrl.weights.receiver.WeightReceiver``, which every engine shares: it
applies updates to a mirror and hands the engine the tensors they changed
(``load_weights``). Applying the newest weights is a step of its own (``apply_weights``,
or ``generate(..., apply_newest=True)`` to save a round trip).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from loomrl.runtime.endpoints import endpoint
from loomrl.types import GenerationRequest, GenerationResult, SamplingParams

if TYPE_CHECKING:
    # in signatures only: the receiver imports torch, this interface does not
    from loomrl.weights.receiver import WeightsApplied

# (prompts, seeds, sampling) -> (token ids, log-probs, finish reasons), one row a sample;
# an engine that applies updates mid-request (the hf engine's in-flight updates) returns a
# fourth item: the version that sampled each token, per row (None: all at the call's first)
SampleFn = Callable[[list[list[int]], list[int], SamplingParams], tuple]


class Generator(ABC):
    """A generation engine holding one copy of the policy.

    ``generate`` samples completions and reports, per token, the log-prob of the sampled
    token under ``log_softmax(logits / temperature)`` (top-p truncation is not folded in),
    and the policy version of the weights used. Weights change only in ``apply_weights``
    or ``update_weights``, never in the middle of a request (except between two decode
    steps with the hf engine's in-flight updates, each token then reporting its version:
    ``loomrl.generation.inflight``); ``generate`` applies them itself only when it is asked
    for a version it does not hold yet. An engine that batches
    continuously marks its own ``generate`` ``@endpoint(concurrent=True)``.
    """

    version: int = 0

    @endpoint
    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], apply_newest: bool = False
    ) -> list[GenerationResult]:
        """One result per request, each with ``request.num_samples`` completions as
        columns (``GenerationResult.from_columns``).

        ``apply_newest=True``: first apply the newest weights the transport holds, as
        ``apply_weights`` does, in the same call (one round trip, not two); the first
        result reports the pause (``weight_apply_s``, ``weight_metrics``)."""

    @endpoint
    @abstractmethod
    def apply_weights(self, min_version: int = 0) -> WeightsApplied:
        """Apply the newest weights the transport holds, waiting until this generator holds
        at least ``min_version``; returns the version and how long it paused."""

    @endpoint
    @abstractmethod
    def update_weights(self, update: object) -> int:
        """Apply a ``loomrl.weights.WeightUpdate`` handed over directly; the new version."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Load ``(name, tensor)`` pairs into the engine's compute weights (what a weight
        update committed; vLLM's ``model.load_weights`` takes the same)."""

    def _apply_for(
        self, requests: list[GenerationRequest], apply_newest: bool
    ) -> WeightsApplied | None:
        """What ``generate`` applies first: the newest weights when asked to, or when a
        request needs a version this generator does not hold yet (None: nothing applied)."""
        needed = max((r.min_version for r in requests), default=0)
        if apply_newest or needed > self.version or self.version < 0:
            return self.apply_weights(needed)
        return None

    @staticmethod
    def _report_apply(results: list[GenerationResult], applied: WeightsApplied | None) -> None:
        """The pause of an apply done by ``generate``, on its first result."""
        if applied is not None:
            results[0].weight_apply_s = applied.apply_s
            results[0].weight_metrics = applied.weight_metrics

    @endpoint
    def offload(self) -> float | None:
        """Release accelerator memory until ``restore``; the time-slicing scheduler and
        colocated turns call it. Implementations return the seconds it took; this default
        holds nothing on a device and releases nothing."""
        return None

    @endpoint
    def restore(self) -> float | None:
        """Reacquire what ``offload`` released; implementations return the seconds it took."""
        return None


def sample_grouped(
    requests: list[GenerationRequest],
    sample: SampleFn,
    tokenizer: Any,
    stop: list[str],
    version: int,
) -> list[GenerationResult]:
    """Every engine's ``generate`` body: requests with the same sampling params are sampled
    as one batch by ``sample``, a request's sample k from seed ``seed * 1_000_003 + k``;
    texts are detokenized here, as vLLM does, in one call a batch (not on the controller's
    loop) and cut at ``stop``; each request's samples (consecutive) become one result of
    columns at ``version``, no object per completion."""
    by_params: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):
        s = req.sampling
        by_params.setdefault((s.temperature, s.top_p, s.max_new_tokens, s.greedy), []).append(i)
    results: list[GenerationResult | None] = [None] * len(requests)
    for indices in by_params.values():
        prompts = [requests[i].prompt_ids for i in indices for _ in range(requests[i].num_samples)]
        seeds = [
            requests[i].seed * 1_000_003 + k
            for i in indices
            for k in range(requests[i].num_samples)
        ]
        ids, logprobs, finish, *more = sample(prompts, seeds, requests[indices[0]].sampling)
        versions = more[0] if more else None
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        if stop:
            cut_at_stop(tokenizer, stop, ids, logprobs, finish, texts, versions)
        start = 0
        for i in indices:
            end = start + requests[i].num_samples
            results[i] = GenerationResult.from_columns(
                ids[start:end],
                logprobs[start:end],
                finish[start:end],
                texts[start:end],
                version,
                versions[start:end] if versions is not None else None,
            )
            start = end
    return results  # type: ignore[return-value]


def cut_at_stop(
    tokenizer: Any,
    stop: list[str],
    ids: list[list[int]],
    logprobs: list[list[float]],
    finish: list[str],
    texts: list[str],
    versions: list[list[int]] | None = None,
) -> None:
    """Cut each completion whose text holds a stop string, in place: its text before the
    first one; its tokens (their log-probs, and versions if given) up to the shortest
    prefix whose text holds it,
    so training sees what was sampled up to the stop (vLLM's rule: the stop string is
    trained on, not shown to the reward); finish reason 'stop'. The sampling loop stops a
    sequence once it looks and sees a stop string (``_holds_stop``); the tokens sampled past
    the stop before it looked are dropped here."""
    for row, text in enumerate(texts):
        found = [at for at in (text.find(s) for s in stop) if at >= 0]
        if not found:
            continue
        texts[row], finish[row] = text[: min(found)], "stop"
        lo, hi = 1, len(ids[row])  # the shortest prefix that decodes to text holding a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = tokenizer.decode(ids[row][:mid], skip_special_tokens=True)
            lo, hi = (lo, mid) if any(s in prefix for s in stop) else (mid + 1, hi)
        ids[row], logprobs[row] = ids[row][:lo], logprobs[row][:lo]
        if versions is not None:  # (the version that sampled each token, cut alike)
            versions[row] = versions[row][:lo]
