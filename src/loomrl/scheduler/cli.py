"""``loomrl scheduler serve|status`` and ``loomrl simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loomrl.scheduler.client import get_json
from loomrl.scheduler.model import SchedulerError
from loomrl.scheduler.simulate import SimJob, cluster_case, llm_d_case, simulate

DEFAULT_URL = "http://127.0.0.1:7878"


def add_scheduler_commands(sub: Any) -> None:
    sched = sub.add_parser(
        "scheduler", help="the time-slicing scheduler: serve it, or see where jobs wait"
    )
    cmds = sched.add_subparsers(dest="scheduler_command", required=True)
    _add_serve_command(cmds)
    _add_status_command(cmds)
    _add_simulate_command(sub)


def _add_serve_command(cmds: Any) -> None:
    serve = cmds.add_parser("serve", help="run the scheduler daemon (loopback by default)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default loopback only)"
    )
    serve.add_argument("--port", type=int, default=7878)
    serve.add_argument(
        "--device",
        action="append",
        dest="devices",
        metavar="NAME[=CORES]",
        help="a device to share: cpu0=0 (CPU cores 0), cpu1=1-3, cuda:0; repeatable "
        "(default cpu0=0)",
    )
    serve.add_argument("--policy", choices=["fifo", "priority", "fair"], default="fair")
    serve.add_argument(
        "--db", default="scheduler.db", help="SQLite file for state and the event log"
    )
    serve.add_argument(
        "--max-hold-s", type=float, help="ask a holder to yield after this long when others wait"
    )
    serve.add_argument(
        "--switch-cost-multiple",
        type=float,
        default=2.0,
        help="hand a device over only when the holder's expected idle gap exceeds this "
        "multiple of its swap cost (0: always)",
    )
    serve.add_argument(
        "--quantum-s", type=float, default=1.0, help="fair policy: credit per round, device-seconds"
    )
    serve.add_argument(
        "--token-file",
        help="where to write the token jobs register with (0600; default "
        "~/.cache/loomrl/scheduler/port-PORT.token, or $LOOMRL_SCHEDULER_TOKEN_FILE)",
    )
    _add_connection_limits(serve)
    serve.set_defaults(fn=cmd_serve)


def _add_connection_limits(serve: Any) -> None:
    """The daemon's guards against too many, or stalled, HTTP connections."""
    serve.add_argument(
        "--max-connections",
        type=int,
        help="open connections at most (default: half the "
        "file-descriptor limit, at most 512); at the cap the oldest idle one is closed",
    )
    serve.add_argument(
        "--max-connections-per-client",
        type=int,
        help="open connections per client address at most (default: --max-connections)",
    )
    serve.add_argument(
        "--idle-timeout-s",
        type=float,
        default=10.0,
        help="close a connection that has not sent a whole request this long after it "
        "opened or after its last answer (an idle or slow-loris client), or that leaves an "
        "answer unread this long",
    )


def _add_status_command(cmds: Any) -> None:
    status = cmds.add_parser(
        "status", help="devices, leases, the queue and jobs of a running daemon"
    )
    status.add_argument("--url", default=DEFAULT_URL)
    status.add_argument("--json", action="store_true", help="the raw snapshot")
    status.set_defaults(fn=cmd_status)


def _add_simulate_command(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate", help="project jobs sharing devices under each policy (discrete events)"
    )
    sim.add_argument(
        "--scenario",
        default="llm-d",
        help="'llm-d' (their published two-job case), 'cluster', or a JSON file of jobs",
    )
    sim.add_argument("--policy", choices=["fifo", "priority", "fair", "all"], default="all")
    sim.add_argument("--duration-s", type=float, default=None, help="simulated seconds")
    sim.add_argument("--num-jobs", type=int, default=32, help="cluster scenario: jobs")
    sim.add_argument("--num-devices", type=int, default=8, help="cluster scenario: devices")
    sim.add_argument("--switch-cost-multiple", type=float, default=0.0)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(fn=cmd_simulate)


def cmd_serve(args: argparse.Namespace) -> int:
    # lazy: the daemon's modules load only for `loomrl scheduler serve`, not with the CLI's parser
    from loomrl.scheduler.server import SchedulerDaemon, parse_devices

    try:
        devices = parse_devices(args.devices or ["cpu0=0"])
        daemon = SchedulerDaemon(
            devices,
            policy=args.policy,
            db_path=args.db,
            host=args.host,
            port=args.port,
            max_hold_s=args.max_hold_s,
            switch_cost_multiple=args.switch_cost_multiple,
            quantum_s=args.quantum_s,
            token_file=args.token_file,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            idle_timeout_s=args.idle_timeout_s,
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"scheduler on {daemon.url} (policy {args.policy}; devices {', '.join(devices)}; state in {args.db}); "
        f"dashboard at {daemon.url}/; jobs register with the token in {daemon.token_file}",
        flush=True,
    )
    daemon.serve_forever()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        snap = get_json(args.url, "/api/status")
    except SchedulerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(snap, indent=2))
    else:
        print_status(snap)
    return 0


def print_status(snap: dict[str, Any]) -> None:
    # lazy: rich loads only when a table is printed
    from rich.console import Console

    console = Console()
    console.print(_devices_table(snap))
    console.print(_queue_table(snap))
    console.print(_jobs_table(snap))


def _devices_table(snap: dict[str, Any]) -> Any:
    # lazy: rich loads only when a table is printed
    from rich.table import Table

    devices = Table(
        title=f"devices (policy {snap['policy']}; utilisation over the last {snap['window_s']:g} s)"
    )
    for col in ("device", "cores", "holder", "phase", "held s", "resident", "utilisation"):
        devices.add_column(col)
    for d in snap["devices"]:
        h = d["holder"] or {}
        devices.add_row(
            d["name"],
            ",".join(map(str, d["cores"] or [])) or "-",
            h.get("job", "-"),
            h.get("phase", "-") + (" (offloading)" if h.get("state") == "evicting" else ""),
            f"{h['held_s']:.1f}" if h else "-",
            d["resident"] or "-",
            f"{d['utilisation']:.0%}",
        )
    return devices


def _queue_table(snap: dict[str, Any]) -> Any:
    # lazy: rich loads only when a table is printed
    from rich.table import Table

    queue = Table(title="queue")
    for col in ("job", "phase", "devices", "waited s", "deadline in s", "why"):
        queue.add_column(col)
    for q in snap["queue"]:
        deadline = "-" if q["deadline_in_s"] is None else f"{q['deadline_in_s']:.1f}"
        queue.add_row(
            q["job"], q["phase"], ",".join(q["devices"]), f"{q['waited_s']:.1f}", deadline, q["why"]
        )
    return queue


def _jobs_table(snap: dict[str, Any]) -> Any:
    # lazy: rich loads only when a table is printed
    from rich.table import Table

    jobs = Table(title="jobs")
    for col in (
        "job",
        "state",
        "priority",
        "weight",
        "device s",
        "swap s",
        "wait s",
        "grants",
        "slowdown",
    ):
        jobs.add_column(col)
    for j in snap["jobs"]:
        jobs.add_row(
            j["name"],
            j["state"],
            str(j["priority"]),
            f"{j['weight']:g}",
            f"{j['device_s']:.1f}",
            f"{j['swap_s']:.2f}",
            f"{j['wait_s']:.1f}",
            str(j["grants"]),
            f"{j['slowdown']:.2f}x",
        )
    return jobs


def _scenario(args: argparse.Namespace):
    if args.scenario == "llm-d":
        return llm_d_case(), args.duration_s or 50_000.0
    if args.scenario == "cluster":
        return cluster_case(args.num_jobs, args.num_devices, args.seed), args.duration_s or 3_600.0
    with open(args.scenario) as f:
        raw = json.load(f)
    jobs = [SimJob(**{**j, "phases": [tuple(p) for p in j["phases"]]}) for j in raw["jobs"]]
    return jobs, args.duration_s or float(raw.get("duration_s", 600.0))


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        jobs, duration = _scenario(args)
    except (OSError, ValueError, TypeError, KeyError) as err:
        print(f"error: scenario {args.scenario!r}: {err}", file=sys.stderr)
        return 2
    rows = _simulate_policies(args, jobs, duration)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_simulation(args, rows, len(jobs), duration)
    return 0


def _simulate_policies(args: argparse.Namespace, jobs: list, duration: float) -> list[dict]:
    """One row per policy: duty, useful duty, throughput against each job alone, fairness."""
    policies = ["fifo", "priority", "fair"] if args.policy == "all" else [args.policy]
    solo = {j.name: simulate([j], "fifo", duration, tick_s=max(0.05, duration / 1e5)) for j in jobs}
    rows = []
    for policy in policies:
        r = simulate(
            jobs,
            policy,
            duration,
            switch_cost_multiple=args.switch_cost_multiple,
            seed=args.seed,
            tick_s=max(0.05, duration / 1e5),
        )
        solo_rate = sum(solo[n].completions[n] for n in r.completions)
        slowdowns = [solo[n].completions[n] / max(c, 1) for n, c in r.completions.items()]
        rows.append(
            {
                "policy": policy,
                "duty": sum(r.duty.values()) / len(r.duty),
                "useful_duty": sum(r.useful_duty.values()) / len(r.useful_duty),
                "solo_duty": sum(sum(s.duty.values()) for s in solo.values()) / len(solo),
                "aggregate_vs_solo": sum(r.completions.values())
                / max(solo_rate / len(jobs), 1e-9)
                / len(r.duty),
                "slowdown_median": sorted(slowdowns)[len(slowdowns) // 2],
                "jain": r.jain,
                "swap_share": r.swap_share,
            }
        )
    return rows


def _print_simulation(
    args: argparse.Namespace, rows: list[dict], num_jobs: int, duration: float
) -> None:
    # lazy: rich loads only when a table is printed
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"simulated: {args.scenario}, {num_jobs} jobs, {duration:g} s")
    for col in (
        "policy",
        "solo duty (mean)",
        "duty",
        "useful duty",
        "aggregate / solo job",
        "slowdown (median)",
        "Jain",
        "swap share",
    ):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["policy"],
            f"{row['solo_duty']:.1%}",
            f"{row['duty']:.1%}",
            f"{row['useful_duty']:.1%}",
            f"{row['aggregate_vs_solo']:.2f}x",
            f"{row['slowdown_median']:.2f}x",
            f"{row['jain']:.3f}",
            f"{row['swap_share']:.1%}",
        )
    Console().print(table)
