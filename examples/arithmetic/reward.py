"""Rewards for the arithmetic task: exact_match (1.0 for the exact answer, else 0.0), and
digits, partial credit for the README's smallest job."""


def exact_match(prompt: str, completion: str, answer: str, **row) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0


def digits(prompt: str, completion: str, **row) -> float:
    """Partial credit a random model can climb: the fraction of the completion's characters
    that are digits (0.0 for an empty one). The README's smallest job learns it from a random
    ``tiny:llama`` in a minute; ``exact_match`` needs the warm-start first."""
    text = completion.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
