"""Offline builders for tiny Llama/Qwen2-shaped models and a character-level tokenizer.

Nothing here touches a model hub: the tokenizer is made in code from printable ASCII and
the model from a config, so tests and the CPU demo run anywhere.
"""

from __future__ import annotations

import string
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# digits, letters, punctuation, space, \t, \n
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII; BOS is prepended to every prompt."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    tok.add_bos_token = True
    return tok


TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 256,
}


def build_tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any):
    """A randomly initialised causal LM of the given family, sized by ``overrides``."""
    # lazy: torch loads when this runs, not with the module
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    opts = {**TINY_DEFAULTS, **overrides}
    unknown = set(opts) - set(TINY_DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown tiny model options {sorted(unknown)}; expected {sorted(TINY_DEFAULTS)}"
        )
    tok = build_char_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=int(opts["hidden_size"]),
        intermediate_size=int(opts["intermediate_size"]),
        num_hidden_layers=int(opts["num_layers"]),
        num_attention_heads=int(opts["num_heads"]),
        num_key_value_heads=int(opts["num_heads"]),
        max_position_embeddings=int(opts["max_position_embeddings"]),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected 'llama' or 'qwen2'")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, tok
