"""The arithmetic judge's format (examples/arithmetic/judge.py): its training examples
carry the exact-match verdict, and the parser reads the first verdict letter or nothing."""

from examples.arithmetic.judge import TEMPLATE, judge_example, verdict
from loomrl.scoring.calls import RewardFailure
from loomrl.scoring.judge import judge_prompt, parse_judgement


def test_an_example_is_the_judge_input_then_the_sum_and_the_exact_match_verdict():
    assert judge_example("12+34=", "046", "046") == {"prompt": "046|12+34=", "answer": "046Y"}
    assert judge_example("12+34=", " 046 ", "046")["answer"] == "046Y"  # exact match strips
    assert judge_example("12+34=", "047", "046") == {"prompt": "047|12+34=", "answer": "046N"}
    assert judge_example("12+34=", "46", "046")["answer"] == "046N"


def test_the_scorer_fills_the_template_as_the_examples_are_written():
    item = ("12+34=", "047", {"answer": "046"})
    assert judge_prompt(TEMPLATE, item) == judge_example("12+34=", "047", "046")["prompt"]


def test_the_verdict_is_the_first_y_or_n_and_anything_else_is_unparsed():
    assert verdict("046Y") == 1.0 and verdict("046N") == 0.0
    assert verdict("046NY") == 0.0
    failure = parse_judgement(verdict, "0467")
    assert isinstance(failure, RewardFailure) and failure.reason == "judge_unparsed"
    assert "0467" in str(failure)
