"""``loomrl status RUN_DIR``: where a run is, running or not, from its run folder alone."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from loomrl.safe_text import escape_controls
from loomrl.telemetry.report import ReportError, _read_json, read_records
from loomrl.telemetry.run_end import failures_by_kind, run_end, running_pid

# The fields of a status that must be numbers; a run folder may come from someone else, so
# each is checked, and one that is not a finite number is listed under "invalid".
NUMBER_FIELDS = (
    "step",
    "num_steps",
    "reward_mean",
    "eval_reward",
    "completions_per_s",
    "elapsed_s",
    "failed",
    "restarts",
)


def _is_number(value: Any) -> bool:
    """A finite int or float (a bool, a string or NaN is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(status: dict[str, Any]) -> None:
    """Set each of ``NUMBER_FIELDS`` that holds something other than a number (or None) to
    None and name it in ``status["invalid"]``."""
    invalid = [k for k in NUMBER_FIELDS if status[k] is not None and not _is_number(status[k])]
    for key in invalid:
        status[key] = None
    if invalid:
        status["invalid"] = invalid


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """State, step, reward, eval, throughput and failures of the run in ``run_dir``."""
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    steps = [r for r in records if "step" in r and "rollout/reward_mean" in r]
    config = _read_json(run_dir / "config.json")
    summary = _read_json(run_dir / "summary.json")
    pid = running_pid(run_dir)
    # a running resume's summary.json is the one its last session left: not this one's
    ended = {} if pid else summary
    trainer = config.get("trainer")
    total = trainer.get("num_steps") if isinstance(trainer, dict) else None
    last = steps[-1] if steps else {}
    evals = [r for r in records if "eval/mean_reward" in r]
    status: dict[str, Any] = {
        "run_dir": str(run_dir),
        **run_end(ended, running=bool(pid)),
        "pid": pid,
        "step": last.get("step", 0),
        "num_steps": total,
        "reward_mean": last.get("rollout/reward_mean"),
        "eval_reward": evals[-1]["eval/mean_reward"] if evals else None,
        "completions_per_s": last.get("throughput/samples_per_s"),
        "elapsed_s": last.get("timing/elapsed_s"),
        "failed": ended.get("failed", last.get("rollout/failed", 0)),
        "failures": failures_by_kind(ended, last),
        "restarts": last.get("executor/restarts", 0),
        "updated_s_ago": time.time() - (run_dir / "metrics.jsonl").stat().st_mtime,
    }
    _check_numbers(status)
    if pid and (endpoint := _endpoint(run_dir)) is not None:
        status["endpoint"] = endpoint
    if (
        status["state"] == "running"
        and status["num_steps"]
        and status["elapsed_s"]
        and status["step"]
    ):
        status["eta_s"] = (
            status["elapsed_s"] / status["step"] * (status["num_steps"] - status["step"])
        )
    return status


def _endpoint(run_dir: Path) -> dict[str, Any] | None:
    """A running job's OpenAI-compatible endpoint (``serve.json``, written by
    ``loomrl.serve.server``): its URL, model and bearer token (``serve_token``, mode 0600:
    readable by the run's own user only, who may hand it to a harness)."""
    info = _read_json(run_dir / "serve.json")
    if not isinstance(info.get("url"), str):
        return None
    token_path = run_dir / "serve_token"
    try:
        token = token_path.read_text().strip()
    except OSError:
        token = None
    return {"url": info["url"], "model": info.get("model"), "token": token}


def format_status(status: dict[str, Any]) -> str:
    """The status as lines for a terminal: numbers formatted, a field that held no number
    shown as ``invalid``, the folder's name escaped (``escape_controls``)."""
    invalid = set(status.get("invalid", ()))

    def num(key: str, fmt: str = ".3f") -> str:
        value = status[key]
        if key in invalid:
            return "invalid"
        return "-" if value is None else format(value, fmt)

    lines = [
        _state_line(status),
        f"  step          {num('step', '.0f')}"
        + (
            f" / {num('num_steps', '.0f')}" if status["num_steps"] or "num_steps" in invalid else ""
        ),
        f"  train reward  {num('reward_mean')}",
        f"  eval reward   {num('eval_reward')}",
        f"  completions/s {num('completions_per_s', '.1f')}",
        f"  elapsed       {num('elapsed_s', '.0f')} s"
        + (f", about {status['eta_s']:.0f} s to go" if "eta_s" in status else ""),
        f"  failed        {num('failed', '.0f')} rollouts, {num('restarts', '.0f')} executor restarts",
        *_failure_lines(status["failures"]),
        f"  last record   {status['updated_s_ago']:.0f} s ago",
    ]
    if "endpoint" in status:
        endpoint = status["endpoint"]
        lines.append(f"  endpoint      {escape_controls(str(endpoint['url']))}")
        lines.append(f"  token         {escape_controls(str(endpoint['token']))}")
    return "\n".join(lines)


def _state_line(status: dict[str, Any]) -> str:
    """``RUN: failed: ValueError: ...``, ``RUN: interrupted by SIGTERM``, ``RUN: running (pid N)``."""
    text = f"{escape_controls(status['run_dir'])}: {status['state']}"
    if status["state"] == "running" and status["pid"]:
        return f"{text} (pid {status['pid']})"
    if status["state"] == "interrupted":
        return f"{text} by {escape_controls(status['signal'])}"
    if status["state"] == "failed" and status["error"]:
        return f"{text}: {escape_controls(status['error'].partition(chr(10))[0])}"
    if status["state"] == "stopped":
        return f"{text} without a summary (killed, or its machine lost)"
    return text


def _failure_lines(failures: dict[str, dict]) -> list[str]:
    """One line per failure kind: its count and its first error's first line."""
    return [
        f"    {escape_controls(kind)} {'-' if f['count'] is None else f['count']}"
        + (f": {escape_controls(f['first_error'])}" if f["first_error"] else "")
        for kind, f in failures.items()
    ]


__all__ = ["ReportError", "format_status", "run_status", "running_pid"]
