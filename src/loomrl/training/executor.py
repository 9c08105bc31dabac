"""Executor objects for the runtime: a trainer with its publisher, a generator with its
subscriber. Both are built where they live (a thread here, a Ray actor later)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

from loomrl.config import JobConfig
from loomrl.generation.hf import HFGenerator, synced_params
from loomrl.models import load_model_and_tokenizer
from loomrl.models.loading import apply_lora
from loomrl.training.checkpoint import save_checkpoint
from loomrl.training.trainer import Trainer
from loomrl.types import Group
from loomrl.weights.codec import CodecOptions
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.transports import Transport, make_transport

# Where an executor is built: a transport object shared with the controller (threads of
# one process), or ``(kind, kwargs)`` for the executor to build its own end (a process).
TransportSpec = Transport | tuple[str, dict]


def _load(cfg: JobConfig):
    model, tokenizer = load_model_and_tokenizer(cfg.model.path, seed=cfg.seed)
    if cfg.model.lora is not None:
        lora = cfg.model.lora
        model = apply_lora(model, lora.r, lora.alpha, lora.target_modules)
    return model, tokenizer


class TrainerExecutor:
    def __init__(self, cfg: JobConfig, sender, owned_transport: Transport | None = None) -> None:
        self.owned_transport = owned_transport  # built here for this executor: closed with it
        model, self.tokenizer = _load(cfg)
        self.trainer = Trainer(
            model, self.tokenizer, cfg.algorithm, cfg.trainer, cfg.generation.temperature
        )
        ws = cfg.weight_sync
        self.publisher = Publisher(
            sender, codec=ws.codec, full_every=ws.full_every, publish_dtype=ws.publish_dtype,
            options=CodecOptions(level=ws.zstd_level),
        )

    @property
    def version(self) -> int:
        return self.trainer.version

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        return self.trainer.train_step(groups)

    def publish(self) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.publisher.publish(synced_params(self.trainer.model), self.trainer.version)
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
        """Move the model, gradients, AdamW state, the KL reference and the publisher's
        last snapshot off the device; returns the seconds it took."""
        if getattr(self, "_swap", None) is None:
            from loomrl.scheduler.offload import Swappable

            t = self.trainer
            last = getattr(self.publisher, "_last", None)
            self._swap = Swappable([t.model] + ([t.reference] if t.reference is not None else []), t.optimizer,
                                   tensor_dicts=[last] if isinstance(last, dict) else [])  # fmt: skip
        return self._swap.offload()

    def restore(self) -> float:
        """Bring back what ``offload`` moved, bit for bit; returns the seconds it took."""
        return self._swap.restore() if getattr(self, "_swap", None) is not None else 0.0

    def save_pretrained(self, path: str) -> None:
        """The final model in ``save_pretrained`` format; a LoRA job also keeps its adapter
        in ``adapter/`` and saves the merged model, which transformers and vLLM load."""
        from loomrl.weights.lora import is_peft_model

        Path(path).mkdir(parents=True, exist_ok=True)
        model = self.trainer.model
        if is_peft_model(model):
            model.save_pretrained(str(Path(path) / "adapter"))
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def build_generator(cfg: JobConfig, receiver) -> HFGenerator:
    model, tokenizer = _load(cfg)
    ws = cfg.weight_sync
    return HFGenerator(
        model, tokenizer, subscriber=Subscriber(receiver, prefetch=ws.prefetch), publish_dtype=ws.publish_dtype
    )


def start_trainer(cfg: JobConfig, transport: TransportSpec) -> TrainerExecutor:
    """The trainer executor with the sending end of ``transport`` (module-level, so a
    ``functools.partial`` of it pickles into a spawned process)."""
    if isinstance(transport, tuple):
        kind, kwargs = transport
        owned = make_transport(kind, **kwargs)
        return TrainerExecutor(cfg, owned.sender(), owned_transport=owned)
    return TrainerExecutor(cfg, transport.sender())


def start_generator(cfg: JobConfig, transport: TransportSpec, rank: int) -> HFGenerator:
    """A generator executor with receiving end ``rank`` of ``transport``."""
    if isinstance(transport, tuple):
        kind, kwargs = transport
        transport = make_transport(kind, **kwargs)
    return build_generator(cfg, transport.receiver(rank))
