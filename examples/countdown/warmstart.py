"""Supervised warm-start of the tiny model for the countdown example (separate from RL).

A randomly initialised character-level model never writes a well-formed expression, so RL
would see no signal. This trains it briefly on (prompt, one reference answer) pairs from
the training split only, and stops early on purpose: the model learns the format and is
right some of the time; RL (with the sandbox scoring answers) takes it from there.

    python -m examples.countdown.warmstart --out .cache/countdown-warmstart
"""

from pathlib import Path

from loomrl.training.sft import warmstart_main

if __name__ == "__main__":
    warmstart_main(
        train_file=Path(__file__).parent / "train.jsonl",
        default_out=".cache/countdown-warmstart",
        default_steps=300,
        description=__doc__,
    )
