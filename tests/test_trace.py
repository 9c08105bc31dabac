"""trace.json: Chrome trace events from every process of a run, whose spans nest within a
thread and whose clocks agree across processes (an executor's own span of a call lies inside
the controller's span of that call)."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

import pytest

from loomrl.job import Job
from loomrl.telemetry import trace


def _check_nesting(events):
    """Spans on one (pid, tid) either nest or are disjoint; returns how many spans it saw."""
    rows = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            rows[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in rows.values():
        open_ends: list[float] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{name} overlaps its parent partly"
            open_ends.append(end)
    return sum(len(s) for s in rows.values())


def test_tracer_writes_nested_spans_and_merge_skips_a_cut_line(tmp_path):
    tracer = trace.start(tmp_path / "t", "controller")
    try:
        with trace.span("outer", "test", k=1):
            with trace.span("inner", "test"):
                time.sleep(0.002)

        def other_thread():
            with trace.span("other", "test"):
                pass

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        with trace.span("call", "call", lane="generator0"):
            pass
    finally:
        trace.stop()
    assert trace.span("ignored", "test").__class__.__name__ == "nullcontext"
    with tracer.path.open("a") as f:
        f.write('{"name": "cut sh')  # a process killed mid-write
    out = trace.merge(tmp_path / "t", tmp_path / "trace.json")
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["name"]: e for e in events}
    assert names["process_name"]["args"] == {"name": "controller"}
    assert names["thread_name"]["args"] == {"name": "generator0"}
    outer, inner = names["outer"], names["inner"]
    assert outer["args"] == {"k": 1} and outer["tid"] == inner["tid"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 2000  # microseconds
    assert names["call"]["tid"] == names["thread_name"]["tid"] != outer["tid"]
    assert names["other"]["tid"] != outer["tid"]  # a thread's spans on its own row
    assert _check_nesting(events) == 4
    assert trace.merge(tmp_path / "none", tmp_path / "x.json") is None


@pytest.mark.parametrize("runtime", ["process"])
def test_a_run_writes_a_trace_whose_clocks_agree_across_processes(tiny_job, runtime):
    result = Job(tiny_job(runtime=runtime, trainer={"num_steps": 2})).run()
    events = json.loads((result.run_dir / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["controller", "generator0", "scorer0", "trainer"]
    assert _check_nesting(events) > 10
    controller = next(p for p, n in processes.items() if n == "controller")
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    calls = defaultdict(list)  # (executor, method) -> the controller's spans of those calls
    for e in events:
        if e["ph"] == "X" and e["cat"] == "call" and e["pid"] == controller:
            calls[lanes[e["pid"], e["tid"]], e["name"]].append(e)
    checked = 0
    for e in events:
        if e["ph"] == "X" and e["cat"] == "executor":
            outer = calls[processes[e["pid"]], e["name"]]
            assert any(
                c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] for c in outer
            ), f"{processes[e['pid']]}.{e['name']} at {e['ts']} lies in no controller call"
            checked += 1
    executed = {(processes[e["pid"]], e["name"]) for e in events if e.get("cat") == "executor"}
    assert {
        ("generator0", "generate"),
        ("trainer", "train_step"),
        ("scorer0", "score_groups"),
    } <= executed
    assert checked >= 8


def test_trace_off_writes_none(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 1}, logging={"trace": False})).run()
    assert not (result.run_dir / "trace.json").exists()
    assert not (result.run_dir / "trace").exists()
