"""Models and tokenizers: local Hugging Face folders, or tiny ones built offline."""

from loomrl.models.loading import (
    ModelLoadError,
    load_model_and_tokenizer,
    load_tokenizer,
    parse_tiny_spec,
)
from loomrl.models.tiny import build_char_tokenizer, build_tiny_model

__all__ = [
    "ModelLoadError",
    "load_tokenizer",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_model_and_tokenizer",
    "parse_tiny_spec",
]
