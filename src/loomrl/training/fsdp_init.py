"""Start-up of the sharded trainer's model (``trainer.parallel.type = "fsdp2"``) from the meta
device, so that no rank ever holds the whole model (torchtitan's and torch's FSDP2 recipe):

1. the model is built from the folder's ``config.json`` on the meta device (shapes, no
   storage; tied embeddings stay one parameter);
2. it is ``fully_shard``-ed with the trainer's per-block policy (``fsdp.shard_model``);
3. ``to_empty`` gives each rank storage for its shards only (1/N of the weights);
4. non-persistent buffers (rotary ``inv_freq``) are recomputed by the model's own
   ``_init_weights``, as ``from_pretrained`` does;
5. each rank copies in its rows of every tensor from the folder's safetensors: a tensor's
   file is opened, the rank's slice read (``get_slice``: those bytes only) and the file
   closed again, so what a rank holds beyond its shards is one tensor's slice.

Each rank's peak is its shards plus one slice, against the whole model in its master dtype
plus the shards on the whole-model start. The loaded model is the ``from_pretrained`` one bit
for bit (tests/test_fsdp_init.py). ``tiny:`` specs (built in code, no folder), folders
without safetensors, and models whose parameters are not stored under their own names or
whose non-persistent buffers are not rotary frequencies start the whole-model way:
``load_policy`` on every rank, then ``shard_model`` (a logged warning says why for a folder).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from loomrl.device import resolve_device
from loomrl.models.loading import build_meta_model, load_policy, load_tokenizer, safetensors_files

logger = logging.getLogger(__name__)


def start_sharded_model(
    model_cfg, dtype: torch.dtype, shard: Callable[[torch.nn.Module], None], seed: int = 0
):
    """``(model, tokenizer)``: the policy with weights in ``dtype`` on ``model_cfg.device``,
    sharded in place by ``shard`` (``fsdp.shard_model`` bound to the mesh): from the meta
    device where the model folder allows it (module docstring), else whole then sharded."""
    if not model_cfg.path.startswith("tiny:"):  # (a tiny: model is built in code, whole)
        files = safetensors_files(model_cfg.path)
        if files is None:
            blocker = "the folder has no safetensors"
        elif model_cfg.lora is not None:
            blocker = "model.lora (its adapter is applied to a whole model)"
        else:
            model = build_meta_model(model_cfg.path, dtype)
            blocker = meta_start_blocker(model, files)
        if blocker is None:
            shard(model)
            model.to_empty(device=resolve_device(model_cfg.device))
            init_non_persistent_buffers(model)
            load_local_shards(model, files)
            logger.info("model %s: meta-device start, this rank's shards read", model_cfg.path)
            return model, load_tokenizer(model_cfg.path)
        logger.warning(
            "model %s: %s; every rank loads the whole model before sharding",
            model_cfg.path,
            blocker,
        )
    model, tokenizer = load_policy(model_cfg, seed=seed, dtype=dtype)
    shard(model)
    return model, tokenizer


def _loaded_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the checkpoint fills: each parameter once (a tied one under its first name) and
    the persistent buffers."""
    tensors = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


def _non_persistent_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if any(
            b in module._non_persistent_buffers_set for b, _ in module.named_buffers(recurse=False)
        )
    }


def meta_start_blocker(model: torch.nn.Module, files: dict[str, Path]) -> str | None:
    """Why the meta-device start cannot load ``model`` (built on meta) from ``files``, or
    None: a tensor not stored under its name (a checkpoint transformers renames on load), or
    a non-persistent buffer that ``_init_weights`` does not recompute (only rotary ones)."""
    missing = sorted(set(_loaded_tensors(model)) - set(files))
    if missing:
        return f"{len(missing)} tensors are not in its safetensors by name ({missing[:3]} ...)"
    for name, module in _non_persistent_owners(model).items():
        if "RotaryEmbedding" not in type(module).__name__:
            return (
                f"non-persistent buffers of {name} ({type(module).__name__}) cannot be recomputed"
            )
    return None


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's part of ``tensor`` in the whole: its DTensor shard's offsets
    and sizes (FSDP2's rows of dim 0), or all of a plain tensor."""
    if hasattr(tensor, "__create_chunk_list__") and hasattr(tensor, "to_local"):
        (chunk,) = tensor.__create_chunk_list__()
        return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
    return tuple(slice(0, n) for n in tensor.shape)


@torch.no_grad()
def load_local_shards(model: torch.nn.Module, files: dict[str, Path]) -> None:
    """Copy into each of ``model``'s parameters and persistent buffers (given storage by
    ``to_empty``) this rank's part of the stored tensor of its name, cast to its dtype."""
    # lazy: safetensors loads only when shards are read
    from safetensors import safe_open

    for name, tensor in _loaded_tensors(model).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        index = local_slices(tensor)
        with safe_open(files[name], framework="pt") as f:  # closed per tensor (see module doc)
            stored = f.get_slice(name)
            shape = tuple(stored.get_shape())
            if shape != tuple(tensor.shape):
                raise ValueError(
                    f"{files[name]}: tensor {name} has shape {shape}, the model's config "
                    f"gives {tuple(tensor.shape)}"
                )
            if local.numel() == 0:  # a rank past the last row of a short dim 0
                continue
            local.copy_(stored[index] if tensor.dim() else f.get_tensor(name))


@torch.no_grad()
def init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Recompute the non-persistent buffers (rotary frequencies; ``to_empty`` left them
    uninitialised) with the model's ``_init_weights``, as ``from_pretrained`` does; each is
    filled with NaN first, so one the model does not recompute fails here by name."""
    owners = _non_persistent_owners(model)
    for module in owners.values():
        for name, buffer in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set and buffer.is_floating_point():
                buffer.fill_(math.nan)
        model._init_weights(module)
    for owner, module in owners.items():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and bool(buffer.isnan().any()):
                raise RuntimeError(f"buffer {owner}.{name} was not recomputed after to_empty")
