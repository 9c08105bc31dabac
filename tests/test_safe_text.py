"""Text from outside reaches the terminal escaped: reward errors (with the completion in them)
through the CLI's log handler, a failed job's error line, and ``loomrl status`` of a handed
run folder whose metrics.jsonl carries escape sequences and strings where numbers belong."""

from __future__ import annotations

import json
import logging
import shutil

from loomrl import cli
from loomrl.safe_text import escape_controls

from conftest import ROOT

# Clear screen, OSC 52 clipboard write, OSC 8 link, window title, a bidi override.
HOSTILE = (
    "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\"
    "\x1b]0;pwned\x07\u202eevil\u2066"
)
RAW = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b")


def _assert_escaped(text: str) -> None:
    assert not any(ch in text for ch in RAW), repr(text)
    assert "\\x1b[2J" in text and "\\x1b]52;c;" in text and "\\u202e" in text


def test_escape_controls_keeps_text_and_newlines():
    assert escape_controls("é ü 中\tok\n") == "é ü 中\tok\n"
    assert escape_controls("a\x7fb\x9bc\u2069") == "a\\x7fb\\x9bc\\u2069"


def test_a_reward_error_quoting_the_completion_reaches_the_console_escaped(capsys):
    logger = logging.getLogger("loomrl.test_safe_text")
    handler = cli.console_log_handler()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ValueError(f"no answer in completion {HOSTILE!s}")
        except ValueError:
            logger.warning(
                "rollout failed scoring (%s, %d so far): %s", "error", 1, HOSTILE, exc_info=True
            )
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    captured = capsys.readouterr()
    text = captured.out + captured.err
    _assert_escaped(text)
    assert "rollout failed scoring" in text and "ValueError: no answer in completion" in text


def test_a_failed_jobs_error_line_is_escaped(capsys):
    def job(on_record):
        raise RuntimeError(f"the job stopped: last failure: reward raised on {HOSTILE}")

    assert cli._execute(job, 1, "/nonexistent-run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RuntimeError: the job stopped")
    _assert_escaped(err)


def test_status_of_a_handed_run_escapes_text_and_reads_numbers_as_numbers(tmp_path, capsys):
    run = shutil.copytree(ROOT / "tests/data/run_fixture", tmp_path / "run")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(records) if "rollout/reward_mean" in r)
    last["rollout/reward_mean"] = HOSTILE
    last["step"] = "\x1b]0;title\x07"
    last["rollout/failed"] = True
    last["throughput/samples_per_s"] = float("nan")
    lines = [json.dumps(r) for r in records] + ["[1, 2]", "7", '"\x1b[2J"']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    config = json.loads((run / "config.json").read_text())
    config["trainer"]["num_steps"] = "\x1b[2J"
    (run / "config.json").write_text(json.dumps(config))
    # an ended run's failed count and its kinds are its summary's
    summary = json.loads((run / "summary.json").read_text())
    summary["failed"] = True
    summary["first_failures"] = {"\x1b[2Jkind": "\x1b]0;title\x07 error"}
    (run / "summary.json").write_text(json.dumps(summary))

    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert not any(ch in out for ch in RAW), repr(out)
    assert "train reward  invalid" in out and "step          invalid / invalid" in out
    assert "completions/s invalid" in out and "failed        invalid rollouts" in out
    assert cli.main(["status", str(run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["reward_mean"] is None and set(status["invalid"]) >= {
        "reward_mean",
        "step",
        "num_steps",
        "failed",
        "completions_per_s",
    }
