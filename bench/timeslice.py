"""Cooperative time-slicing: one job alone, then two and three jobs sharing one device.

The device is CPU core 0 (a lease pins the phase's thread there); everything else of the
jobs (tool calls, heartbeats) and the scheduler daemon run on the other core. Each job
(bench/timeslice_job.py) repeats: generate (device) -> the environment's tool calls
(off the device) -> train with loomrl's Trainer (device). The tool time is set to
``--tool-ratio`` times the device time per step measured in a short calibration, so a
job alone leaves the device idle about half the time: two such jobs are complementary.

Scenarios, each ``--repeats`` times (interleaved), medians reported:
  solo        one job                      (the baseline of every ratio)
  pair        two identical jobs, fair policy
  trio        three identical jobs, fair policy
  mixed-fifo  three jobs with 1x, 2x, 3x the batch, fifo   (fairness baseline)
  mixed-fair  the same three, fair policy

Printed: device duty cycle (share of the window the device was held, swaps included),
useful duty (phases proper), what ``loomrl simulate`` predicts from the phase, gap and
swap times measured in the same scenario ("sim duty"; the goal's comparison) and from the
solo run's phase times ("sim from solo"; a prediction before sharing), aggregate steps/s against the solo job, each job's slowdown against solo, Jain's
index over device-seconds, and swap (offload + restore) time as a share of the window.

    python bench/timeslice.py --window-s 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.scheduler.server import SchedulerDaemon  # noqa: E402
from loomrl.scheduler.simulate import SimJob, jain, simulate  # noqa: E402

JOB = Path(__file__).with_name("timeslice_job.py")
SCENARIOS = {
    "solo": ("fair", [1]),
    "pair": ("fair", [1, 1]),
    "trio": ("fair", [1, 1, 1]),
    "mixed-fifo": ("fifo", [1, 2, 3]),
    "mixed-fair": ("fair", [1, 2, 3]),
}


def run(
    policy: str, sizes: list[int], args: argparse.Namespace, tool_s: float, window_s: float
) -> dict:
    daemon = SchedulerDaemon(
        {"cpu0": [0]},
        policy=policy,
        switch_cost_multiple=args.switch_cost_multiple,
        quantum_s=args.quantum_s,
        tick_s=0.01,
    ).start()
    sync = Path(tempfile.mkdtemp(prefix="timeslice-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(JOB),
                "--url",
                daemon.url,
                "--name",
                f"job{i}",
                "--sync",
                str(sync),
                "--groups",
                str(args.groups * size),
                "--tool-s",
                f"{tool_s:.4f}",
                "--seed",
                str(i),
                "--heartbeat-s",
                str(args.heartbeat_s),
            ],
            env=env,
        )
        for i, size in enumerate(sizes)
    ]
    try:
        while not all((sync / f"job{i}.ready").exists() for i in range(len(sizes))):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("a bench job failed during warm-up")
            time.sleep(0.05)
        start = time.time() + 0.5
        # jobs run on past the window
        (sync / "go").write_text(json.dumps([start, start + window_s + 3.0]))
        for p in procs:
            if p.wait(timeout=window_s + 300) != 0:
                raise RuntimeError(f"bench job exited with {p.returncode}")
        spans = [s for s in daemon.core.intervals if s["device"] == "cpu0"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        daemon.stop()
    jobs = [json.loads((sync / f"job{i}.json").read_text()) for i in range(len(sizes))]
    return measure(jobs, spans, start, start + window_s)


def clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def measure(jobs: list[dict], spans: list[dict], lo: float, hi: float) -> dict:
    window = hi - lo
    held = sum(clip(s["start"], s["end"], lo, hi) for s in spans)
    per_job_device = {
        j["name"]: sum(clip(s["start"], s["end"], lo, hi) for s in spans if s["job"] == j["name"])
        for j in jobs
    }
    useful = sum(clip(x["body_start"], x["body_end"], lo, hi) for j in jobs for x in j["leases"])
    swap = sum(
        x["restore_s"] + x["offload_s"]
        for j in jobs
        for x in j["leases"]
        if lo <= x["released"] <= hi
    )
    swap += sum(j["offload_s_total"] for j in jobs) - sum(
        x["offload_s"] for j in jobs for x in j["leases"]
    )
    rates = {j["name"]: sum(1 for t in j["cycles"] if lo <= t <= hi) / window for j in jobs}
    phases = {}
    for j in jobs:
        for ph in ("generate", "train"):
            phases[(j["name"], ph)] = statistics.median(
                x["body_end"] - x["body_start"] for x in j["leases"] if x["phase"] == ph
            )
    restores = [x["restore_s"] for j in jobs for x in j["leases"] if x["restore_s"] > 0]
    offloads = [x["offload_s"] for j in jobs for x in j["leases"] if x["offload_s"] > 0]
    gaps = [
        b["requested"] - a["released"]
        for j in jobs
        for a, b in zip(j["leases"], j["leases"][1:])
        if a["phase"] == "generate"
    ]
    return {
        "duty": held / window,
        "useful_duty": useful / window,
        "rates": rates,
        "device_s": per_job_device,
        "jain": jain(list(per_job_device.values())),
        "swap_share": swap / window,
        "phases": phases,
        "restore_s": statistics.median(restores) if restores else 0.0,
        "offload_s": statistics.median(offloads) if offloads else 0.0,
        "tool_gap_s": statistics.median(gaps),
        "jobs": jobs,
    }


def predict(
    phases: dict,
    gap_s: float,
    sizes: list[int],
    policy: str,
    swap: dict,
    args: argparse.Namespace,
    window_s: float,
    scale: bool,
) -> float:
    """The simulator's duty cycle for this scenario from phase, gap and swap times: with
    ``scale``, job0's phases times k for a job of batch k x (the solo run's phases);
    otherwise each job's own phase times (measured in the scenario itself)."""

    def own(i: int, ph: str, k: int) -> float:
        return phases[("job0", ph)] * k if scale else phases[(f"job{i}", ph)]

    jobs = [
        SimJob(
            f"job{i}",
            [("device", own(i, "generate", k)), ("idle", gap_s), ("device", own(i, "train", k))],
            offload_s=swap["offload_s"],
            restore_s=swap["restore_s"],
            start_s=0.05 * i,
            jitter=0.05,
        )
        for i, k in enumerate(sizes)
    ]
    results = [
        simulate(
            jobs,
            policy,
            max(window_s, 60.0) * 5,
            switch_cost_multiple=args.switch_cost_multiple,
            quantum_s=args.quantum_s,
            tick_s=0.01,
            heartbeat_s=args.heartbeat_s,
            seed=s,
        ).duty["dev0"]
        for s in range(3)
    ]
    return statistics.median(results)


def calibrate(args: argparse.Namespace) -> float:
    probe = run("fair", [1], args, tool_s=0.0, window_s=4.0)
    device = probe["phases"][("job0", "generate")] + probe["phases"][("job0", "train")]
    return device * args.tool_ratio


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--window-s", type=float, default=20.0, help="measured seconds per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--groups", type=int, default=8, help="prompts per step of a 1x job (4 rollouts each)"
    )
    p.add_argument("--tool-ratio", type=float, default=1.1, help="tool time / device time per step")
    p.add_argument("--tool-s", type=float, help="fixed tool time instead of --tool-ratio")
    p.add_argument("--heartbeat-s", type=float, default=0.05)
    p.add_argument("--switch-cost-multiple", type=float, default=2.0)
    p.add_argument("--quantum-s", type=float, default=0.5)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    # keep core 0 for leases
    os.sched_setaffinity(0, {c for c in os.sched_getaffinity(0) if c != 0} or {0})
    tool_s = args.tool_s if args.tool_s is not None else calibrate(args)
    names = args.scenarios.split(",")
    if "solo" not in names:
        names.insert(0, "solo")
    print(
        f"tool calls: {tool_s:.3f} s per step; window {args.window_s:g} s; {args.repeats} repeats; "
        f"device = core 0 of {os.cpu_count()}",
        flush=True,
    )
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            policy, sizes = SCENARIOS[name]
            results[name].append(run(policy, sizes, args, tool_s, args.window_s))
            print(f"  repeat {r + 1} {name}: duty {results[name][-1]['duty']:.1%}", flush=True)
    report(results, args, tool_s)


def med(values) -> float:
    return statistics.median(list(values))


def report(results: dict[str, list[dict]], args: argparse.Namespace, tool_s: float) -> None:
    solo_runs = results["solo"]
    solo_rate = med(r["rates"]["job0"] for r in solo_runs)
    rows = []
    for name, runs in results.items():
        policy, sizes = SCENARIOS[name]
        swap = {
            "offload_s": med(r["offload_s"] for r in runs),
            "restore_s": med(r["restore_s"] for r in runs),
        }
        solo_phases = {k: med(r["phases"][k] for r in solo_runs) for k in solo_runs[0]["phases"]}
        own_phases = {k: med(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
        predicted = predict(
            own_phases,
            med(r["tool_gap_s"] for r in runs),
            sizes,
            policy,
            swap,
            args,
            args.window_s,
            scale=False,
        )
        from_solo = predict(
            solo_phases,
            med(r["tool_gap_s"] for r in solo_runs),
            sizes,
            policy,
            swap,
            args,
            args.window_s,
            scale=True,
        )
        identical = set(sizes) == {1}
        slowdowns = [
            solo_rate / max(med(r["rates"][f"job{i}"] for r in runs), 1e-9)
            for i in range(len(sizes))
        ]
        rows.append(
            {
                "scenario": name,
                "policy": policy,
                "jobs": len(sizes),
                "duty": med(r["duty"] for r in runs),
                "useful_duty": med(r["useful_duty"] for r in runs),
                "predicted_duty": predicted,
                "from_solo": from_solo,
                "swap_ms": 1e3 * (swap["offload_s"] + swap["restore_s"]),
                "gen_s": med(own_phases[(f"job{i}", "generate")] for i in range(len(sizes))),
                "train_s": med(own_phases[(f"job{i}", "train")] for i in range(len(sizes))),
                "aggregate": med(sum(r["rates"].values()) for r in runs),
                "vs_solo": med(sum(r["rates"].values()) for r in runs) / solo_rate
                if identical
                else None,
                "slowdowns": slowdowns if identical else None,
                "jain": med(r["jain"] for r in runs),
                "swap_share": med(r["swap_share"] for r in runs),
                "device_s": {k: med(r["device_s"][k] for r in runs) for k in runs[0]["device_s"]},
            }
        )
    head = (
        "scenario",
        "policy",
        "jobs",
        "gen/train s",
        "duty",
        "useful",
        "sim duty",
        "sim err",
        "sim from solo",
        "steps/s",
        "vs solo",
        "slowdown per job",
        "Jain",
        "swap ms",
        "swap/wall",
    )
    print(f"\n{' | '.join(head)}")
    print(" | ".join("---" for _ in head))
    for r in rows:
        err = (r["predicted_duty"] - r["duty"]) / r["duty"]
        print(
            " | ".join(
                [
                    r["scenario"],
                    r["policy"],
                    str(r["jobs"]),
                    f"{r['gen_s']:.3f}/{r['train_s']:.3f}",
                    f"{r['duty']:.1%}",
                    f"{r['useful_duty']:.1%}",
                    f"{r['predicted_duty']:.1%}",
                    f"{err:+.1%}",
                    f"{r['from_solo']:.1%}",
                    f"{r['aggregate']:.2f}",
                    "-" if r["vs_solo"] is None else f"{r['vs_solo']:.2f}x",
                    "-"
                    if r["slowdowns"] is None
                    else " ".join(f"{s:.2f}x" for s in r["slowdowns"]),
                    f"{r['jain']:.3f}",
                    f"{r['swap_ms']:.1f}",
                    f"{r['swap_share']:.2%}",
                ]
            )
        )
    print("\ndevice-seconds per job in the window (median):")
    for r in rows:
        print(
            f"  {r['scenario']:<11} " + "  ".join(f"{k} {v:.1f}" for k, v in r["device_s"].items())
        )
    by = {r["scenario"]: r for r in rows}
    goals = [
        ("solo duty < 50%", by["solo"]["duty"], by["solo"]["duty"] < 0.50),
        (
            "pair duty >= 90%",
            by.get("pair", {}).get("duty"),
            by.get("pair", {}).get("duty", 0) >= 0.90,
        ),
        (
            "pair aggregate >= 1.7x solo",
            by.get("pair", {}).get("vs_solo"),
            (by.get("pair", {}).get("vs_solo") or 0) >= 1.7,
        ),
        (
            "Jain >= 0.95 (mixed-fair)",
            by.get("mixed-fair", {}).get("jain"),
            by.get("mixed-fair", {}).get("jain", 0) >= 0.95,
        ),
        (
            "swap <= 5% of wall (all)",
            max(r["swap_share"] for r in rows),
            max(r["swap_share"] for r in rows) <= 0.05,
        ),
        (
            "sim within 10% of duty (all)",
            max(abs(r["predicted_duty"] - r["duty"]) / r["duty"] for r in rows),
            all(abs(r["predicted_duty"] - r["duty"]) / r["duty"] <= 0.10 for r in rows),
        ),
    ]
    print("\ngoal | measured | met")
    print("--- | --- | ---")
    for goal, value, ok in goals:
        shown = (
            "-"
            if value is None
            else (
                f"{value:.2f}x"
                if "aggregate" in goal
                else f"{value:.3f}"
                if "Jain" in goal
                else f"{value:.1%}"
            )
        )
        print(f"{goal} | {shown} | {'yes' if ok else 'NO'}")
    print(f"\n(solo job: {solo_rate:.2f} steps/s; tool calls {tool_s:.3f} s per step)")


if __name__ == "__main__":
    main()
