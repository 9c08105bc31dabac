"""Reward for the arithmetic task: 1.0 for the exact answer, else 0.0."""


def exact_match(prompt: str, completion: str, answer: str, **row) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0
