"""Load a model and tokenizer from a local folder or a ``tiny:`` spec. No hub access."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from transformers.utils import logging as hf_logging

from loomrl.models.tiny import TINY_DEFAULTS, build_char_tokenizer, build_tiny_model

if TYPE_CHECKING:
    from loomrl.config_common import ModelConfig


class ModelLoadError(ValueError):
    """A model spec that names nothing loadable."""


def parse_tiny_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``'tiny:qwen2?hidden_size=64&num_layers=2'`` -> ``('qwen2', {...})``."""
    body = spec.removeprefix("tiny:")
    arch, _, query = body.partition("?")
    opts: dict[str, Any] = {}
    for key, value in parse_qsl(query, strict_parsing=bool(query)):
        if key not in TINY_DEFAULTS:
            raise ModelLoadError(
                f"{spec!r}: unknown option {key!r}; expected one of {sorted(TINY_DEFAULTS)}"
            )
        try:
            opts[key] = int(value)
        except ValueError:
            raise ModelLoadError(
                f"{spec!r}: option {key} must be an integer, got {value!r}"
            ) from None
    _check_tiny_size(spec, opts)
    return arch or "llama", opts


# The largest ``tiny:`` model built (parameters): 1 G, 4 GB of fp32 weights before gradients and
# AdamW's state triple it. A spec past it is a typo or a hostile job file; real models load
# from a folder.
TINY_MAX_PARAMS = 1_000_000_000


def tiny_num_params(opts: dict[str, Any]) -> int:
    """The parameters a ``tiny:`` model of ``opts`` has (tied embeddings over the character
    vocabulary; q, k, v, o; a gated MLP; two norms a layer and a final one), computed from
    the spec alone, before anything is allocated."""
    sizes = {**TINY_DEFAULTS, **opts}
    hidden, inner, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_layers"]
    vocab = 128  # the character tokenizer's ~104 tokens, rounded up
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * inner + 2 * hidden
    return layers * per_layer + vocab * hidden + hidden


def _check_tiny_size(spec: str, opts: dict[str, Any]) -> None:
    for key, value in opts.items():
        if value < 1:
            raise ModelLoadError(f"{spec!r}: option {key} must be at least 1, got {value}")
    params = tiny_num_params(opts)
    if params > TINY_MAX_PARAMS:
        raise ModelLoadError(
            f"{spec!r}: a tiny model of about {params / 1e9:.3g} G parameters "
            f"({params * 4 / 2**30:.3g} GiB in fp32) is over the limit of "
            f"{TINY_MAX_PARAMS / 1e9:g} G (models.loading.TINY_MAX_PARAMS); refused before "
            "building it. Load a larger model from a folder (model.path)"
        )


def load_model_and_tokenizer(spec: str, *, seed: int = 0, dtype=None):
    """Returns ``(model, tokenizer)`` with the model in ``dtype`` (default fp32) on the CPU,
    in train mode off. A tiny model is initialised in fp32 and then cast, so its weights
    are the fp32 ones rounded, whatever the dtype."""
    # lazy: torch loads when this runs, not with the module
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    hf_logging.disable_progress_bar()
    if spec.startswith("tiny:"):
        arch, opts = parse_tiny_spec(spec)
        model, tok = build_tiny_model(arch, seed=seed, **opts)
    else:
        path = Path(spec)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model path {spec!r} is not a local Hugging Face model folder (no config.json); "
                "use a folder written by save_pretrained, or a 'tiny:llama' spec"
            )
        check_tokenizer_files(path)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = _from_pretrained(AutoModelForCausalLM, path, dtype or torch.float32)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def _from_pretrained(auto_class, path: Path, dtype):
    """``auto_class.from_pretrained`` of a local folder; a pickled weights file that
    ``torch.load(weights_only=True)`` refuses (it would run code) is a ``ModelLoadError``
    naming the file and the folder, not torch's traceback."""
    try:
        return auto_class.from_pretrained(path, local_files_only=True, dtype=dtype)
    except pickle.UnpicklingError as err:
        reason = next(
            (line.strip() for line in str(err).splitlines() if "WeightsUnpickler" in line),
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        files = ", ".join(sorted(p.name for p in path.glob("*.bin"))) or "a .bin file"
        raise ModelLoadError(
            f"model folder {path}: {files} holds more than tensors and plain data, refused "
            f"unloaded (torch.load(weights_only=True): {reason}); loading it would run code: "
            "use weights in .safetensors from a source you trust"
        ) from None


# A tokenizer's vocabulary comes in one of these files (a fast tokenizer's tokenizer.json, a
# SentencePiece model, a BPE vocab.json with merges.txt, a WordPiece vocab.txt, tiktoken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
)


def check_tokenizer_files(path: Path) -> None:
    """A model folder must hold its tokenizer: without a vocabulary file transformers builds
    an empty tokenizer that fails much later (``cannot reshape tensor of 0 elements``, "no
    chat template"). A ``ModelLoadError`` naming the folder, what it lacks and what it holds."""
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    held = sorted(p.name for p in path.iterdir())
    raise ModelLoadError(
        f"model folder {str(path)!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}; "
        f"it holds {held}): save the tokenizer beside the model "
        f"(tokenizer.save_pretrained({str(path)!r})) or copy those files from the base model's folder"
    )


def load_tokenizer(spec: str):
    """The tokenizer alone (no model weights are read)."""
    if spec.startswith("tiny:"):
        parse_tiny_spec(spec)
        return build_char_tokenizer()
    # lazy: transformers loads when this runs, not with the module
    from transformers import AutoTokenizer

    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model path {spec!r} is not a local Hugging Face model folder (no config.json); "
            "use a folder written by save_pretrained, or a 'tiny:llama' spec"
        )
    check_tokenizer_files(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def model_context_length(spec: str) -> int | None:
    """Positions the model attends over (prompt plus completion), read from its config
    without loading weights; None when the config does not say."""
    if spec.startswith("tiny:"):
        _, opts = parse_tiny_spec(spec)
        return int({**TINY_DEFAULTS, **opts}["max_position_embeddings"])
    try:
        config = json.loads((Path(spec) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def apply_lora(model, r: int, alpha: float, target_modules: list[str]):
    """Wrap ``model`` with a fresh PEFT LoRA adapter; only the adapter trains."""
    # lazy: peft is optional (the lora extra)
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in target_modules if m not in names]
    if missing:
        raise ModelLoadError(f"LoRA target modules {missing} not found in the model")
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0
    )
    return get_peft_model(model, config)


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_dtype(model_cfg: ModelConfig, device=None):
    """The compute dtype ``model.dtype`` means on ``device`` (default: ``model.device``
    resolved): 'auto' is bfloat16 where the device computes bf16 natively (CUDA, a CPU with
    AVX512-BF16, AMX or Arm BF16: ``loomrl.device.bf16``) and float32 elsewhere.
    Generators load their model in it; the trainer keeps its KL reference in it."""
    # lazy: torch loads when this runs, not with the module
    import torch

    from loomrl.device import resolve_device
    from loomrl.device.bf16 import machine_precision

    device = torch.device(device) if device is not None else resolve_device(model_cfg.device)
    if model_cfg.dtype == "auto":
        return machine_precision(device).dtype
    return getattr(torch, _DTYPES[model_cfg.dtype])


def load_policy(model_cfg: ModelConfig, *, seed: int = 0, dtype=None):
    """The job's policy model (with a fresh LoRA adapter when ``model.lora`` is set) on
    ``model.device``, and its tokenizer; trainer and generators both start from it.
    ``dtype``: of its weights; by default ``resolve_dtype(model_cfg)`` (the generators'
    compute dtype); the trainer asks for its master dtype (``trainer.precision``)."""
    # lazy: torch loads when a model is, not with this module
    from loomrl.device import resolve_device

    device = resolve_device(model_cfg.device)
    dtype = dtype if dtype is not None else resolve_dtype(model_cfg, device)
    model, tokenizer = load_model_and_tokenizer(model_cfg.path, seed=seed, dtype=dtype)
    if model_cfg.lora is not None:
        lora = model_cfg.lora
        model = apply_lora(model, lora.r, lora.alpha, lora.target_modules)
    return model.to(device), tokenizer


def safetensors_files(spec: str) -> dict[str, Path] | None:
    """Each tensor name of a model folder's safetensors -> the file holding it (from
    ``model.safetensors.index.json`` when the weights are split over files); None for a
    ``tiny:`` spec or a folder without safetensors (``pytorch_model.bin``). Reads headers only."""
    if spec.startswith("tiny:"):
        return None
    path = Path(spec)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        return None
    # lazy: safetensors loads only when shards are read
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def build_meta_model(spec: str, dtype):
    """The model of folder ``spec`` built from its ``config.json`` on the meta device (no
    storage: shapes and dtypes only, tied weights tied), in eval mode, with the folder's
    generation config; its weights are to be loaded (``loomrl.training.fsdp_init``)."""
    # lazy: torch loads when this runs, not with the module
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {spec!r} is not a local Hugging Face model folder")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval()
