"""The vLLM generation engine (``[generation.engine] type = "vllm"``).

The same contract as the HF engine (``loomrl.generation.base.Generator``): each sample draws
from its own seed, every sampled token comes with its log-prob under
``log_softmax(logits / T)`` and the policy version of the weights that made it (weights
change only between calls, so a result's version is every one of its tokens' version).

Weights come through the shared ``WeightReceiver``: it verifies an update (per-tensor crc32
and the whole-model digest) and commits it to its mirror, then hands ``load_weights`` the
tensors that changed; this engine reloads them into vLLM (every vLLM call is in
``loomrl.generation.vllm_adapter``). A reload that fails leaves vLLM unable to generate,
so the engine is then restarted from the mirror (the last verified weights) and the restart
is counted (``generation/vllm_restarts``).

``quantize`` ('fp8': ``generation.engine.quantize``) starts vLLM with its own online quantization
(``vllm_adapter.VLLM_QUANTIZATION``). The mirror stays unquantized; every reload sends its
bf16 tensors in checkpoint format, and vLLM's layerwise reload quantizes each layer it
rebuilds again, so the engine stays quantized and follows every update.
"""

from __future__ import annotations

import gc
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch

from loomrl.generation import vllm_adapter
from loomrl.generation.base import Generator, sample_grouped
from loomrl.generation.engine_config import VllmEngineConfig
from loomrl.generation.hf import eos_token_ids
from loomrl.types import GenerationRequest, GenerationResult, SamplingParams
from loomrl.weights.params import published_state
from loomrl.weights.publisher import DTYPES, Subscriber
from loomrl.weights.receiver import WeightReceiver, WeightsApplied

logger = logging.getLogger(__name__)

# vLLM fuses a decoder layer's q/k/v and gate/up projections into one parameter, and a
# reload rebuilds a fused parameter from the tensors it is given: a delta that changed q
# but not k would leave k unset. So a reload carries every tensor of each decoder layer it
# touches (tested: reloading q_proj alone put the log-probs 0.74 off).
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def tied_aliases(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """``{alias: name}`` for each state-dict entry that shares its storage with a published
    tensor but is not published itself (a tied output head: ``lm_head.weight`` is
    ``model.embed_tokens.weight``). vLLM keeps its own copy of such a head, which a reload
    leaves stale unless it is sent too (tested: 0.82 off without it)."""
    by_ptr = {t.data_ptr(): name for name, t in model.state_dict().items() if name in set(names)}
    return {
        alias: by_ptr[t.data_ptr()]
        for alias, t in model.state_dict().items()
        if alias not in by_ptr.values() and t.data_ptr() in by_ptr
    }


def reload_groups(changed: Iterable[str], names: Iterable[str]) -> list[str]:
    """``changed`` widened to whole decoder layers (``...layers.N.``), in ``names`` order."""
    changed = set(changed)
    layers = {m.group(1) for m in map(_LAYER.match, changed) if m}

    def wanted(name: str) -> bool:
        m = _LAYER.match(name)
        return name in changed or (m is not None and m.group(1) in layers)

    return [name for name in names if wanted(name)]


class VllmGenerator(Generator):
    """Generation with vLLM on the model's device; weights from a ``WeightReceiver``;
    ``quantize``: 'none' or 'fp8' (vLLM's online fp8, kept through every reload)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        engine: VllmEngineConfig | None = None,
        subscriber: Subscriber | None = None,
        publish_dtype: str = "bfloat16",
        stop: list[str] | None = None,
        seed: int = 0,
        quantize: str = "none",
    ) -> None:
        self.engine_cfg = engine or VllmEngineConfig()
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.eos_ids = sorted(eos_token_ids(model, tokenizer))
        self.device_type = vllm_adapter.platform_device_type()  # where vLLM runs
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.seed = seed
        self.quantize = quantize  # vLLM's online quantization of the Linear layers
        if quantize != "none" and self.device_type == "cpu":  # jobs refuse it (executor.py)
            logger.warning(
                "quantize=%r on vLLM's CPU backend: torch's emulated fp8 matmuls, hundreds of "
                "times slower than bf16 (for tests of the update path)",
                quantize,
            )
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        if self.engine_cfg.max_model_len is not None:
            self.max_model_len = self.engine_cfg.max_model_len
        self.model_dir = tempfile.mkdtemp(prefix="loomrl-vllm-")
        model.save_pretrained(self.model_dir)
        tokenizer.save_pretrained(self.model_dir)
        mirror = published_state(model, DTYPES[publish_dtype])
        self.aliases = tied_aliases(model, mirror)
        self.receiver = WeightReceiver(mirror, self.load_weights, subscriber)
        self.counts = {"restarts": 0, "reloads": 0, "reset_refusals": 0, "offloads": 0}
        self.last_reload_s = 0.0
        self.offloaded = False
        self._reload_on_restore = False  # weights committed to the mirror while offloaded
        self.llm = self._start()

    def _engine_factory(self):
        """What starts this generator's engine (``vllm.LLM`` here; AsyncLLM in the async one)."""
        return vllm_adapter.start_llm

    def _start(self) -> Any:
        return self._engine_factory()(
            self.model_dir,
            dtype=self.dtype,
            seed=self.seed,
            device_type=self.device_type,
            engine=self.engine_cfg,
            max_model_len=self.max_model_len,
            quantize=self.quantize,
        )

    # -- weights -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.receiver.version

    @property
    def mirror(self) -> dict[str, torch.Tensor]:
        return self.receiver.mirror

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the changed tensors (widened to whole decoder layers, from the mirror the
        receiver just verified); restart from the mirror if vLLM fails part-way."""
        if self.offloaded:  # asleep or stopped: ``restore`` loads the whole mirror
            self._reload_on_restore = True
            return
        names = reload_groups((name for name, _ in weights), self.mirror)
        t0 = time.perf_counter()
        try:
            refused = vllm_adapter.reload_weights(self.llm, self._with_aliases(names))
        except Exception:  # vLLM's errors have no common base: any one leaves it broken
            logger.exception("vLLM weight reload failed; restarting it from the verified mirror")
            self.restart()
        else:
            self.counts["reset_refusals"] += refused
        self.counts["reloads"] += 1
        self.last_reload_s = time.perf_counter() - t0

    def _with_aliases(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """The mirror's ``names``, and each tied alias of one of them under its own name."""
        chosen = set(names)
        tied = [
            (alias, self.mirror[name]) for alias, name in self.aliases.items() if name in chosen
        ]
        return [(name, self.mirror[name]) for name in names] + tied

    def _stop_engine(self) -> None:
        """Stop vLLM and let its memory go before anything starts another engine here:
        vLLM measures the free device memory when it starts, and an in-process engine still
        referenced (``self.llm`` during a restart) or in an uncollected cycle would hold it."""
        llm, self.llm = self.llm, None
        try:
            vllm_adapter.shutdown(llm)
        finally:
            del llm
            gc.collect()  # the engine's tensors go now, not at some later collection
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialized

    def restart(self) -> None:
        """A fresh engine holding the mirror's weights (counted in the metrics)."""
        try:
            self._stop_engine()
        except Exception:  # already dead: nothing to stop
            logger.warning("stopping the old vLLM engine failed", exc_info=True)
        self.llm = self._start()
        vllm_adapter.reload_weights(self.llm, self._with_aliases(list(self.mirror)))
        self.counts["restarts"] += 1

    def _heal(self) -> None:
        """Restart an engine whose engine-core process is gone (multi-process mode)."""
        if not vllm_adapter.engine_alive(self.llm):
            logger.warning("vLLM's engine core is gone; restarting it from the verified mirror")
            self.restart()

    def update_weights(self, update) -> int:
        return self.receiver.apply(update)

    def apply_weights(self, min_version: int = 0) -> WeightsApplied:
        return self.receiver.apply_newest(min_version)

    def metrics(self) -> dict[str, float]:
        """``generation/vllm_*``: reloads, restarts, refused prefix-cache resets, last reload s."""
        return {
            "generation/vllm_reloads": float(self.counts["reloads"]),
            "generation/vllm_restarts": float(self.counts["restarts"]),
            "generation/vllm_prefix_reset_refusals": float(self.counts["reset_refusals"]),
            "generation/vllm_reload_s": self.last_reload_s,
            "generation/vllm_offloads": float(self.counts["offloads"]),
        }

    # -- time-slicing --------------------------------------------------------------------

    def offload(self) -> float:
        """Free the engine's device memory until ``restore``; the seconds it took. On CUDA,
        vLLM's sleep mode (level 1: weights to host memory, key/value cache dropped). vLLM
        has no sleep mode on a CPU: there the engine is stopped (its weights and key/value
        cache freed) and ``restore`` starts it again from the verified mirror, so memory
        the scheduler or a colocated trainer counts on is really free."""
        t0 = time.perf_counter()
        if not self.offloaded:
            if self.device_type == "cuda":
                vllm_adapter.sleep(self.llm, level=1)
            else:
                self._stop_engine()
            self.offloaded = True
            self.counts["offloads"] += 1
        return time.perf_counter() - t0

    def restore(self) -> float:
        """Undo ``offload``; weights committed meanwhile are loaded now. The seconds."""
        t0 = time.perf_counter()
        if self.offloaded:
            if self.llm is None:  # stopped (CPU): a fresh engine, then the mirror's weights
                self.llm = self._start()
                self._reload_on_restore = True
            else:
                vllm_adapter.wake_up(self.llm)
            if self._reload_on_restore:
                vllm_adapter.reload_weights(self.llm, self._with_aliases(list(self.mirror)))
            self._reload_on_restore = self.offloaded = False
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the engine and the receiver; remove the model folder vLLM loaded."""
        self.receiver.close()
        if self.llm is not None:
            self._stop_engine()
        shutil.rmtree(self.model_dir, ignore_errors=True)

    # -- sampling ------------------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], apply_newest: bool = False
    ) -> list[GenerationResult]:
        applied = self._apply_for(requests, apply_newest)
        if not requests:
            return []
        if self.offloaded:
            self.restore()
        self._heal()
        try:
            results = self._generate_grouped(requests)
        except Exception as err:
            if not vllm_adapter.is_engine_dead(err):
                raise
            logger.warning("vLLM's engine core died; restarting it from the verified mirror")
            self.restart()  # the same call again: sampling is a function of the seeds
            results = self._generate_grouped(requests)
        self._report_apply(results, applied)
        results[0].engine_metrics = self.metrics()
        return results

    def _generate_grouped(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return sample_grouped(requests, self._sample, self.tokenizer, self.stop, self.version)

    def _sample(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """One vLLM call for a batch of one sampling's prompts, the prefix cache salted by
        the policy version."""
        return vllm_adapter.sample(
            self.llm,
            prompts,
            seeds,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            greedy=sampling.greedy,
            stop_token_ids=self.eos_ids,
            cache_salt=f"loomrl-v{self.version}",
        )
