"""``loomrl report RUN_DIR``: one self-contained HTML page (``report.html``) of a run folder.

Built from what the run folder holds (``metrics.jsonl``, ``summary.json``, ``trace.json``),
so it works on a finished run, a stopped one, or a copy of one: reward and eval over steps
and over wall time, completions/s, staleness, an executor timeline from the trace (idle gaps
visible), busy fraction per executor, weight-sync bytes and time, failures by reason. The
figures are PNGs drawn with matplotlib and embedded, so the page is one file to send.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from loomrl.safe_text import escape_controls
from loomrl.telemetry.run_end import failures_by_kind, run_end, running_pid

logger = logging.getLogger(__name__)

REPORT_FILE = "report.html"
LANE_COLORS = {"generator": "#4c72b0", "trainer": "#dd8452", "scorer": "#55a868"}


class ReportError(ValueError):
    """A folder that holds no run to report on."""


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (a last line cut short by a killed run, and a line that is
    not a JSON object, are skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl; is this a loomrl run folder?")
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _series(records: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    pairs = [(r[x], r[key]) for r in records if key in r and x in r and r[key] is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    # lazy: matplotlib loads only when a report is drawn
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _line_figure(records, keys: dict[str, str], x: str, xlabel: str, ylabel: str, title: str):
    # lazy: matplotlib loads only when a report is drawn
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    drawn = False
    for key, label in keys.items():
        xs, ys = _series(records, key, x)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def _reward_keys(records: list[dict]) -> dict[str, str]:
    keys = {"rollout/reward_mean": "train reward (mean)", "eval/mean_reward": "eval reward"}
    for key in sorted({k for r in records for k in r if k.startswith("reward/")}):
        keys[key] = key.removeprefix("reward/").removesuffix("_mean")
    return keys


def _call_lanes(trace_events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """``{executor: [(start s, duration s), ...]}`` of the controller's calls."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace_events if e["name"] == "thread_name"
    }
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in trace_events:
        lane = names.get((e.get("pid"), e.get("tid")))
        if e.get("ph") == "X" and e.get("cat") == "call" and lane:
            spans[lane].append((e["ts"] / 1e6, e["dur"] / 1e6))
    return spans


def _zoom_window(spans: dict[str, list[tuple[float, float]]], t0: float, end: float):
    """A window a few train steps wide in the middle of the run (whole calls visible), or
    None for a run short enough to read whole."""
    steps = sorted(spans.get("trainer", []))
    if end - t0 < 20 or len(steps) < 12:
        return None
    mid = len(steps) // 2
    return steps[mid][0] - t0, steps[mid + 5][0] + steps[mid + 5][1] - t0


def _draw_lanes(ax, spans, lanes: list[str], t0: float, window=None) -> None:
    for row, lane in enumerate(lanes):
        bars = [(s - t0, d) for s, d in spans[lane]]
        color = LANE_COLORS.get(lane.rstrip("0123456789"), "#8172b3")
        edges = {} if window is None else {"edgecolors": "white", "linewidth": 0.5}
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, **edges)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.grid(axis="x", alpha=0.3)
    if window is not None:
        ax.set_xlim(*window)


def _timeline_figure(trace_events: list[dict]):
    """The controller's call lanes over wall time, one bar per call an executor ran: the
    whole run, and a window of six train steps in its middle where gaps and overlaps show."""
    # lazy: matplotlib loads only when a report is drawn
    import matplotlib.pyplot as plt

    spans = _call_lanes(trace_events)
    if not spans:
        return None, {}
    t0 = min(s for lane in spans.values() for s, _ in lane)
    end = max(s + d for lane in spans.values() for s, d in lane)
    lanes = sorted(spans, key=lambda n: (n.rstrip("0123456789"), n))
    window = _zoom_window(spans, t0, end)
    rows = 1 if window is None else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, rows * (0.9 + 0.45 * len(lanes))), squeeze=False)
    _draw_lanes(axes[0][0], spans, lanes, t0)
    axes[0][0].set(
        xlabel="wall time since the first call (s)", title="executor timeline (calls in flight)"
    )
    if window is not None:
        _draw_lanes(axes[1][0], spans, lanes, t0, window)
        axes[1][0].set(
            xlabel="wall time since the first call (s)",
            title=f"six train steps from {window[0]:.1f} s (gaps: an executor waiting)",
        )
    fig.tight_layout()
    busy = {
        lane: _union_length([(s - t0, d) for s, d in spans[lane]]) / max(end - t0, 1e-9)
        for lane in lanes
    }
    return _png(fig), busy


def _union_length(bars: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, dur in sorted(bars):
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _bar_figure(values: dict[str, float], xlabel: str, title: str):
    # lazy: matplotlib loads only when a report is drawn
    import matplotlib.pyplot as plt

    if not values:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 0.6 + 0.35 * len(values)))
    ax.barh(list(values), list(values.values()), color="#4c72b0")
    ax.set(xlabel=xlabel, title=title)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _failures(summary: dict, records: list[dict]) -> dict[str, float]:
    """Executor faults, stale drops and failed rollouts by kind, as counted in
    ``summary.json`` (``failures_by_kind``) or, without it, the newest step record."""
    counts = {k: v for k, v in summary.get("faults", {}).items() if v}
    last = records[-1] if records else {}
    for key in ("rollout/dropped_stale", "weight_sync/send_failures"):
        if last.get(key):
            counts[key] = last[key]
    for kind, failure in failures_by_kind(summary, last).items():
        if failure["count"]:
            counts[f"failed: {kind}"] = failure["count"]
    total = summary.get("failed", last.get("rollout/failed"))
    if total and not any(k.startswith("failed: ") for k in counts):
        # a summary written before failures_by_kind: the total, not a guess per kind
        counts["failed (all kinds)"] = total
    return counts


# (title, {metric: label}, x key, x label, y label) of each line figure after the reward ones
LINE_FIGURES = [
    (
        "Throughput",
        {"throughput/samples_per_s": "completions/s"},
        "step",
        "step",
        "completions per second",
    ),
    (
        "Staleness",
        {"rollout/staleness_mean": "mean", "rollout/staleness_max": "max"},
        "step",
        "step",
        "policy versions behind (trained rollouts)",
    ),
    (
        "Groups with nothing to learn from",
        {
            "rollout/zero_variance_wrong_frac": "all wrong",
            "rollout/zero_variance_right_frac": "all right",
            "rollout/truncated_frac": "completions truncated",
        },
        "step",
        "step",
        "fraction of the step's groups (completions)",
    ),
    (
        "Weight sync bytes",
        {"weight_sync/bytes_sent": "sent", "weight_sync/bytes_full": "a full copy"},
        "step",
        "step",
        "bytes per publish",
    ),
    (
        "Weight sync time",
        {
            "timing/publish_s": "publish (trainer)",
            "weight_sync/generator_apply_s": "apply (generator)",
        },
        "step",
        "step",
        "seconds",
    ),
]


def _draw(title: str, fn, *args):
    """``fn(*args)``, or a ``ReportError`` naming the figure it could not draw (a run folder
    may come from elsewhere: any value in it may be of the wrong type)."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - named and raised again as the report's error
        raise ReportError(
            f"could not draw the figure {title!r} ({type(err).__name__}: {err})"
        ) from err


def _figures(run_dir: Path, records: list[dict], summary: dict) -> list[tuple[str, str | None]]:
    rewards = _reward_keys(records)
    trace_events = _read_json(run_dir / "trace.json").get("traceEvents", [])
    timeline, busy_from_trace = _draw("Executor timeline", _timeline_figure, trace_events)
    busy = {
        k.removeprefix("executor/").removesuffix("_busy_frac"): v
        for k, v in (records[-1] if records else {}).items()
        if k.endswith("_busy_frac")
    } or busy_from_trace
    lines = {
        title: _draw(title, _line_figure, records, keys, x, xlabel, ylabel, title.lower())
        for title, keys, x, xlabel, ylabel in LINE_FIGURES
    }
    by_step = (records, rewards, "step", "step", "reward", "reward")
    by_time = (records, rewards, "timing/elapsed_s", "wall time (s)", "reward", "reward")
    return [
        ("Reward over steps", _draw("Reward over steps", _line_figure, *by_step)),
        ("Reward over wall time", _draw("Reward over wall time", _line_figure, *by_time)),
        ("Throughput", lines["Throughput"]),
        ("Staleness", lines["Staleness"]),
        ("Executor timeline", timeline),
        (
            "Busy fraction",
            _draw("Busy fraction", _bar_figure, busy, "fraction of the run busy", "busy fraction"),
        ),
        ("Weight sync bytes", lines["Weight sync bytes"]),
        ("Weight sync time", lines["Weight sync time"]),
        (
            "Failures by reason",
            _draw(
                "Failures by reason", _bar_figure, _failures(summary, records), "count", "failures"
            ),
        ),
    ]


def _text(value: Any) -> str:
    """``value`` as HTML text: control characters escaped (``escape_controls``), then
    HTML's own (a run folder's name, config and summary may come from elsewhere)."""
    return html.escape(escape_controls(str(value)))


def _summary_rows(summary: dict, records: list[dict]) -> list[tuple[str, str]]:
    rows = [("steps", str(summary.get("steps", len(records))))]
    for key, label in (
        ("elapsed_s", "training time (s)"),
        ("samples_per_s", "completions/s"),
        ("generated", "rollouts generated"),
        ("trained", "rollouts trained"),
        ("dropped_stale", "dropped as stale"),
        ("dropped_zero_variance", "dropped: zero variance"),
        ("short_steps", "steps short of a batch"),
        ("failed", "failed"),
        ("eval_start", "eval reward at start"),
        ("eval_end", "eval reward at end"),
    ):
        if key in summary:
            value = summary[key]
            rows.append((label, f"{value:.3f}" if isinstance(value, float) else str(value)))
    return rows


def _end_html(summary: dict, records: list[dict], running: bool) -> str:
    """How the run ended (``run_end``) and each failure kind's count and first error."""
    summary = {} if running else summary
    end = run_end(summary, running)
    state = {"stopped": "stopped without a summary (killed?)"}.get(end["state"], end["state"])
    if end["signal"]:
        state += f" by {end['signal']}"
    parts = [f"<p><b>{_text(state)}</b>" + (f": {_text(end['error'])}" if end["error"] else "")]
    failures = failures_by_kind(summary, records[-1] if records else {})
    parts += [
        f"<br>failed {_text(kind)}: {_text(f['count'])}"
        + (f" (first: <code>{_text(f['first_error'])}</code>)" if f["first_error"] else "")
        for kind, f in failures.items()
    ]
    return "".join(parts) + "</p>"


def _all_figures(run_dir: Path, records: list[dict], summary: dict, out: Path) -> list:
    """Every figure, its text drawn as text (a metric key with ``$...$`` is not mathtext).
    On failure the page at ``out`` is removed, so no report of an earlier state stays in
    place, and the ``ReportError`` says so."""
    # lazy: matplotlib loads only when a report is drawn
    import matplotlib

    matplotlib.use("Agg", force=True)
    try:
        with matplotlib.rc_context({"text.parse_math": False}):
            return _figures(run_dir, records, summary)
    except ReportError as err:
        removed = out.is_file()
        out.unlink(missing_ok=True)
        raise ReportError(
            f"{run_dir}: {err}; no report written"
            + (f" (the old {out} was removed)" if removed else "")
        ) from err


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``out`` (default ``RUN_DIR/report.html``) and return its path."""
    run_dir = Path(run_dir)
    records = [r for r in read_records(run_dir) if "step" in r]
    summary = _read_json(run_dir / "summary.json")
    config = _read_json(run_dir / "config.json")
    out = Path(out) if out is not None else run_dir / REPORT_FILE
    figures = _all_figures(run_dir, records, summary, out)
    parts = [
        "<!doctype html><meta charset=utf-8>",
        f"<title>loomrl report: {_text(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
        "img{max-width:100%;border:1px solid #ddd;margin:.3em 0}td{padding:2px 12px}"
        "h2{font-size:1.1em;margin-top:1.6em}</style>",
        f"<h1>Run {_text(config.get('name', run_dir.name))}</h1>",
        f"<p>{_text(run_dir)}: {len(records)} step records. The timeline comes from "
        "<code>trace.json</code> (open it in ui.perfetto.dev).</p>",
        _end_html(summary, records, running_pid(run_dir) is not None),
        "<table>"
        + "".join(
            f"<tr><td>{_text(k)}</td><td>{_text(v)}</td></tr>"
            for k, v in _summary_rows(summary, records)
        )
        + "</table>",
    ]
    for title, png in figures:
        if png is not None:
            alt = _text(title)
            parts.append(f'<h2>{alt}</h2><img alt="{alt}" src="data:image/png;base64,{png}">')
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(out)
    return out
