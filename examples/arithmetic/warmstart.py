"""Supervised warm-start of the tiny model for the arithmetic example (separate from RL).

A randomly initialised tiny model never samples a correct sum, so RL has no signal. This
script trains it briefly on (prompt, answer) pairs from the training split only, with the
loss on the answer tokens, and stops early on purpose: the model learns the format and is
right some of the time, and RL takes it from there. Eval rows are never seen here.

    python -m examples.arithmetic.warmstart --out .cache/arithmetic-warmstart

The result is a normal Hugging Face folder (``save_pretrained``) that the job loads as
``model.path``. It is rebuilt only if missing or built with other settings.
"""

from pathlib import Path

from loomrl.training.sft import warmstart_main

if __name__ == "__main__":
    warmstart_main(
        train_file=Path(__file__).parent / "train.jsonl",
        default_out=".cache/arithmetic-warmstart",
        default_steps=350,
        description=__doc__,
    )
