"""GSM8K rewards: correctness checked with math-verify, and a format reward.

A completion's final answer is what follows its last ``####`` (GSM8K's own form), else what
math-verify extracts from LaTeX (``\\boxed{72}``, ``$72$``, ``\\frac{144}{2}``) or the text's
last number. The gold answer is the ``#### N`` line of the row's ``answer`` column. Both are
loomrl-signature rewards, ``fn(prompt, completion, **row) -> float``, combined with weights in
the job file's ``[[task.rewards]]``.
"""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

# math-verify warns on every call that its signal-based timeout is off; it must be off here,
# since rewards run on worker threads (signals work on the main thread only) and loomrl
# enforces task.reward_timeout_s itself.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_FINAL = re.compile(r"####\s*(.+)")
_BOXED_OR_HASHES = re.compile(r"(####\s*-?[\d,.]+|\\boxed\{[^{}]+\})\s*$")


def gold_answer(answer: str) -> str:
    """The number after GSM8K's ``####``, commas dropped: ``'... #### 1,234'`` -> ``'1234'``."""
    found = _FINAL.findall(answer)
    if not found:
        raise ValueError(f"a GSM8K answer ends with '#### N'; got {answer[-60:]!r}")
    return found[-1].strip().replace(",", "")


def final_answer(completion: str) -> list:
    """math-verify's parse of the completion's final answer (empty when there is none)."""
    if "####" in completion:
        text = completion.rsplit("####", 1)[1].strip().replace(",", "")
        return parse(text, parsing_timeout=None) if text else []
    return parse(completion, parsing_timeout=None)


def correctness(prompt, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's final answer equals the gold answer, else 0.0."""
    predicted = final_answer(completion)
    if not predicted:
        return 0.0
    gold = parse(f"${gold_answer(answer)}$", parsing_timeout=None)
    return float(verify(gold, predicted, timeout_seconds=None))


def format_reward(prompt, completion: str, **row) -> float:
    """1.0 when the completion ends with a final answer line (``#### N`` or ``\\boxed{N}``)."""
    return float(bool(_BOXED_OR_HASHES.search(completion.strip())))
