"""A generative judge for the arithmetic task: it checks a sum by working it out.

The judge is a causal LM that reads ``TEMPLATE`` filled in with the completion and the
prompt (``'047|12+34='``), writes the sum itself (``'046'``) and then its verdict, ``Y``
when the completion is that sum and ``N`` when not (``'046N'``); ``verdict`` turns the text
into 1.0 or 0.0. It scores a job through::

    [task.scorer]
    type = "judge"
    path = "<the judge's folder>"
    prompt_template = "{completion}|{prompt}"
    parser = "examples.arithmetic.judge:verdict"
    max_new_tokens = 5

``judge_example`` writes one supervised example of that format; the learning check
(``tests/test_reward_model_learning.py``) trains a judge on such examples from the
training split, labelled by exact match, and scores RL with it.
"""

from __future__ import annotations

TEMPLATE = "{completion}|{prompt}"
VERDICTS = {"Y": 1.0, "N": 0.0}


def verdict(text: str) -> float | None:
    """1.0 for a judgement whose first verdict letter is ``Y``, 0.0 for ``N``; None (an
    unparsed judgement, a counted scoring failure) when it has neither."""
    for char in text:
        if char in VERDICTS:
            return VERDICTS[char]
    return None


def judge_example(prompt: str, completion: str, answer: str) -> dict[str, str]:
    """One training example: the judge's input for (prompt, completion) and the judgement
    it should write (the sum, then the exact-match verdict)."""
    right = completion.strip() == str(answer)
    return {
        "prompt": TEMPLATE.format(prompt=prompt, completion=completion),
        "answer": f"{answer}{'Y' if right else 'N'}",
    }
