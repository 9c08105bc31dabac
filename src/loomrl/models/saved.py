"""A model object given to ``Job(model=...)`` as a folder the executors load: every executor
(a thread, a process, a Ray actor) loads its model by path, so an object in the caller's
memory is saved once, with its tokenizer, to a cache folder named by its content."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from loomrl.data_sources import cache_root

logger = logging.getLogger(__name__)


def models_root() -> Path:
    """``$LOOMRL_CACHE_DIR/models`` (default ``~/.cache/loomrl/models``)."""
    return cache_root().parent / "models"


def save_model_object(model: Any, tokenizer: Any) -> str:
    """The folder of ``model`` (a transformers ``PreTrainedModel``) and ``tokenizer``, saved
    with ``save_pretrained`` under ``models_root()`` as ``model-<digest of the files>``
    (written once; a second call with the same weights finds it)."""
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.utils import logging as hf_logging

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model= takes a model folder, a 'tiny:' spec or a transformers PreTrainedModel "
            f"(with its tokenizer as processing_class=), not a {type(model).__name__}"
        )
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        got = "nothing" if tokenizer is None else f"a {type(tokenizer).__name__}"
        raise TypeError(
            f"model= got a {type(model).__name__} object: give its tokenizer as processing_class= "
            f"(as TRL's GRPOTrainer takes it), got {got}; or save both with save_pretrained(folder) "
            "and pass model=folder"
        )
    # (no "Writing model shards" bar in the user's console)
    hf_logging.disable_progress_bar()
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"model.tmp{os.getpid()}-{id(model)}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target = root / f"model-{_digest(tmp)}"
    if target.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            os.replace(tmp, target)
        except OSError:
            # another process wrote the same content first
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("model= object saved at %s", target)
    return str(target)


def _digest(folder: Path) -> str:
    """A digest of a folder's files (names and bytes), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:16]
