"""The trainer executor: a ``Trainer`` with its weight publisher, built where it lives (a
thread, a process, a Ray actor later). Generators are built in ``loomrl.generation.executor``;
the two meet only through the weights they publish and receive."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loomrl.config_common import AlgorithmConfig, ModelConfig
from loomrl.device import resolve_device
from loomrl.device.offload import Swappable
from loomrl.models.loading import load_policy, resolve_dtype
from loomrl.training.base import PublishAfterStepError, TrainerEndpoints
from loomrl.training.checkpoint import save_checkpoint
from loomrl.training.config import TrainerConfig
from loomrl.training.precision import master_dtype, resolve_precision
from loomrl.training.trainer import Trainer
from loomrl.types import Group
from loomrl.weights.codec import CodecOptions
from loomrl.weights.config import WeightSyncConfig
from loomrl.weights.lora import is_peft_model
from loomrl.weights.params import synced_params
from loomrl.weights.publisher import Publisher
from loomrl.weights.quantized import QuantizedPublish
from loomrl.weights.transports import Transport, TransportSpec, open_transport


@dataclass(frozen=True)
class TrainerSetup:
    """What the trainer executor is built from: its sections of the job's config, and the
    few job-wide values it needs, resolved (pickles into a spawned process or an actor)."""

    model: ModelConfig
    trainer: TrainerConfig
    algorithm: AlgorithmConfig
    weight_sync: WeightSyncConfig
    seed: int  # the job's: the initial weights of a 'tiny:' model
    temperature: float  # generation.temperature: the behaviour policy's log-probs are at it
    trace: bool  # trainer.trace resolved for the runtime
    runtime: str  # 'local', 'process' or 'ray'
    # generation.engine.quantize: what weight_sync.publish_quantized publishes
    quantize: str = "none"
    # generation.max_new_tokens: dr_grpo's constant divisor, the end of overlong='soft''s ramp
    max_new_tokens: int | None = None


class TrainerExecutor(TrainerEndpoints):
    _swap = _snapshot_swap = None  # loomrl.device.offload.Swappable, made at the first offload

    def __init__(self, cfg: TrainerSetup, sender, owned_transport: Transport | None = None) -> None:
        self.owned_transport = owned_transport  # built here for this executor: closed with it
        device = resolve_device(cfg.model.device)
        model, self.tokenizer = self._load_model(cfg, device)
        self.trainer = self._build_trainer(cfg, model, device)
        ws = cfg.weight_sync
        self.publisher = Publisher(
            sender,
            codec=ws.codec,
            full_every=ws.full_every,
            publish_dtype=ws.publish_dtype,
            options=CodecOptions(level=ws.zstd_level),
            quantized=(
                QuantizedPublish.of_model(self.trainer.model, cfg.quantize)
                if ws.publish_quantized
                else None
            ),
        )

    def _load_model(self, cfg: TrainerSetup, device):
        """The model and tokenizer: the trained weights in their master dtype (fp32 unless
        trainer.precision='bf16'), never rounded through the generators' compute dtype on
        the way. (A sharded rank starts its shards from the meta device instead.)"""
        master = master_dtype(resolve_precision(cfg.trainer, device))
        return load_policy(cfg.model, seed=cfg.seed, dtype=master)

    def _build_trainer(self, cfg: TrainerSetup, model, device) -> Trainer:
        """The ``Trainer`` of ``model`` (a sharded executor shards the model first)."""
        return Trainer(
            model,
            self.tokenizer,
            cfg.algorithm,
            cfg.trainer,
            cfg.temperature,
            trace=cfg.trace,
            reference_dtype=resolve_dtype(cfg.model, device),
            max_completion_tokens=cfg.max_new_tokens,
        )

    @property
    def version(self) -> int:
        return self.trainer.version

    def train_step(self, groups: list[Group], publish: bool = False) -> dict[str, float]:
        metrics = self.trainer.train_step(groups)
        if publish:
            try:
                metrics.update(self.publish())
            except Exception as err:
                raise PublishAfterStepError(
                    f"step {self.trainer.version} was trained but publishing it failed: {type(err).__name__}: {err}"
                ) from err
        return metrics

    def publish(self, full: bool = False) -> dict[str, float]:
        """Publish the current version. An offloaded trainer (colocated generators, or a
        scheduler that took the device) publishes without coming back
        (``_publish_offloaded``)."""
        if self._swap is not None and self._swap.offloaded:
            return self._publish_offloaded(full)
        t0 = time.perf_counter()
        metrics = self.publisher.publish(
            synced_params(self.trainer.model), self.trainer.version, full=full
        )
        metrics["timing/publish_s"] = time.perf_counter() - t0
        return metrics

    def _publish_offloaded(self, full: bool) -> dict[str, float]:
        """A publish while offloaded (a restarted generator's full snapshot inside its
        generate phase; a publish between a scheduler's leases) reads the published
        parameters and the publisher's last snapshot (the delta base), nothing else: the
        gradients, the AdamW moments (twice the parameters in fp32) and the KL reference
        stay away, so it takes none of the memory the offload freed for the other side.
        The parameters are read where they wait, on the host (``Swappable.lend``: pinned
        copies on CUDA, shared memory on a CPU). A byte lane (inproc, shm, files,
        torch_dist) casts and encodes on the host anyway, so the device sees nothing; the
        tensor lane packs and digests on the device (CUDA IPC), so the published tensors
        alone are copied there for it, and freed after. The bytes are those of the same
        publish from the device (host and device round to the published dtype alike). The
        new snapshot is offloaded in turn: the trainer is as offloaded after it as before."""
        t0 = time.perf_counter()
        if self._snapshot_swap is not None:
            self._snapshot_swap.restore()  # host memory: on a CPU its pages mapped back
        try:
            with self._swap.lend([self.trainer.model]):
                state = synced_params(self.trainer.model)
                read_bytes = sum(t.nbytes for t in state.values())
                if self.publisher.sender.carries_tensors:
                    state = {k: t.to(self.trainer.device) for k, t in state.items()}
                metrics = self.publisher.publish(state, self.trainer.version, full=full)
                del state
        finally:
            self._offload_snapshot()
            if self.trainer.device.type == "cuda":
                torch.cuda.empty_cache()
        metrics["weight_sync/offloaded_read_bytes"] = float(read_bytes)
        metrics["timing/publish_s"] = time.perf_counter() - t0
        return metrics

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def save_checkpoint(self, root: str, step: int, extra: dict, keep: int) -> str:
        """Checkpoint the trainer (model, optimizer, version) plus ``extra`` atomically."""
        return str(save_checkpoint(Path(root), step, {"trainer": self.state_dict(), **extra}, keep))

    def close(self) -> None:
        if self.owned_transport is not None:
            self.owned_transport.close()
            self.owned_transport = None

    # -- time-slicing (loomrl.scheduler): the state leaves the device while another job has it

    def offload(self) -> float:
        """Move the model, gradients, AdamW state and the KL reference off the device, and on
        a CPU the publisher's last snapshot out of the process; returns the seconds it took."""
        if self._swap is None:
            t = self.trainer
            self._swap = Swappable(
                [t.model] + ([t.reference] if t.reference is not None else []), t.optimizer
            )
        if self.trainer.traces is not None:  # traces hold the tensors offload replaces
            self.trainer.traces.clear()
        return self._swap.offload() + self._offload_snapshot()

    def _offload_snapshot(self) -> float:
        """The publisher's last snapshot (replaced at every publish) leaves the process with
        the rest on a CPU, where host memory is the device's. On CUDA it is host memory
        already: copying it into shared memory at every offload would free nothing."""
        last = self.publisher.last_snapshot
        if last is None or self.trainer.device.type != "cpu":
            return 0.0
        if self._snapshot_swap is None or self._snapshot_swap.tensor_dicts[0] is not last:
            self._snapshot_swap = Swappable([], tensor_dicts=[last])  # the old one is dropped
        return self._snapshot_swap.offload()

    def restore(self) -> float:
        """Bring back what ``offload`` moved, bit for bit; returns the seconds it took."""
        if self._swap is None:
            return 0.0
        seconds = self._swap.restore()
        if self._snapshot_swap is not None:
            seconds += self._snapshot_swap.restore()
        return seconds

    def save_pretrained(self, path: str) -> None:
        """The final model in ``save_pretrained`` format; a LoRA job also keeps its adapter
        in ``adapter/`` and saves the merged model, which transformers and vLLM load."""
        Path(path).mkdir(parents=True, exist_ok=True)
        model = self.trainer.model
        if is_peft_model(model):
            model.save_pretrained(str(Path(path) / "adapter"))
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def start_trainer(cfg: TrainerSetup, transport: TransportSpec) -> TrainerExecutor:
    """The trainer executor with the sending end of ``transport`` (module-level, so a
    ``functools.partial`` of it pickles into a spawned process)."""
    transport, owned = open_transport(transport)
    return TrainerExecutor(cfg, transport.sender(), owned_transport=transport if owned else None)
