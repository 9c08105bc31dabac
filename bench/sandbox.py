"""Sandbox benchmark: warm-pool exec latency against cold starts, throughput, buffer misses.

    .venv/bin/python bench/sandbox.py [--backend auto] [--execs 500] [--burst-s 20]

Prints, in one run: exec latency p50/p99 of ``print(1)`` from the warm pool next to a cold
``bwrap`` start and a plain ``subprocess`` start of the same snippet; executions per
second at concurrency 1, 2, 4, 8; and the buffer miss rate under a bursty load, before
and after the warm buffer has adapted. Goals: warm p50 <= 5 ms, p99 <= 20 ms,
>= 200 execs/s on a 2-core machine, misses < 1% once adapted.

Then per-episode workspaces (``--workspace-only`` runs just these): open / call / close
latency next to a plain pool exec, episodes/s and sandbox calls/s at concurrency 1, 2, 4
(an episode: open, write a module, import it, run a shell command, close) next to plain
execs/s, and how many sandboxes a fresh pool keeps alive as the episode rate rises and
falls (``--rate-s`` seconds per rate) against Little's law.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from loomrl.sandbox import SandboxLimits, SandboxPool
from loomrl.sandbox.backends import bwrap_launch, bwrap_path, sandbox_python
from loomrl.sandbox.pool import PEAK_WINDOW_S

SNIPPET = "print(1)"


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return pick(0.50), pick(0.99)


def time_runs(fn, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def cold_bwrap_argv() -> list[str]:
    """The pool's own bwrap flags, running the snippet directly instead of the fork server."""
    spec = bwrap_launch({})
    argv = [a for a in spec.argv if a != "--seccomp"]
    argv = argv[: argv.index(sandbox_python())]  # drop the server command
    drop = {str(fd) for fd in spec.pass_fds}
    return [a for a in argv if a not in drop] + [sandbox_python(), "-I", "-c", SNIPPET]


def latency_rows(pool: SandboxPool, n: int) -> list[tuple[str, float, float]]:
    for _ in range(50):
        pool.exec(SNIPPET)
    rows = [("warm pool exec", *percentiles(time_runs(lambda: pool.exec(SNIPPET), n)))]
    if bwrap_path():
        argv = cold_bwrap_argv()
        cold = time_runs(lambda: subprocess.run(argv, capture_output=True, check=True), n // 5)
        rows.append(("cold bwrap start", *percentiles(cold)))
    plain = [sandbox_python(), "-I", "-c", SNIPPET]
    rows.append(
        (
            "plain subprocess",
            *percentiles(
                time_runs(lambda: subprocess.run(plain, capture_output=True, check=True), n // 5)
            ),
        )
    )
    return rows


def throughput(pool: SandboxPool, concurrency: int, n: int) -> float:
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda _: pool.exec(SNIPPET), range(n // 4)))  # warm up to this concurrency
        t0 = time.perf_counter()
        list(ex.map(lambda _: pool.exec(SNIPPET), range(n)))
    return n / (time.perf_counter() - t0)


def bursty_misses(pool: SandboxPool, seconds: float, seed: int = 0) -> tuple[float, float, int]:
    """Bursts of 1..8 concurrent execs at random gaps; miss rate in each half."""
    rng = random.Random(seed)
    halves = []
    for _ in range(2):
        before = pool.metrics()
        end = time.monotonic() + seconds / 2
        while time.monotonic() < end:
            threads = [
                threading.Thread(target=pool.exec, args=(SNIPPET,))
                for _ in range(rng.randint(1, 8))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(rng.choice([0.0, 0.01, 0.05, 0.2]))
        after = pool.metrics()
        claims = after["sandbox/claims"] - before["sandbox/claims"]
        misses = after["sandbox/buffer_misses"] - before["sandbox/buffer_misses"]
        halves.append((misses / claims if claims else 0.0, int(claims)))
    return halves[0][0], halves[1][0], halves[1][1]


def episode(pool: SandboxPool, hold_s: float = 0.0) -> tuple[float, int]:
    """One agent episode's sandbox work: open a workspace, write a module, import it, run a
    shell command on what it wrote, (think for ``hold_s``), close. Returns the open
    latency (s) and the sandbox calls made."""
    t0 = time.perf_counter()
    with pool.workspace() as ws:
        opened = time.perf_counter() - t0
        ws.write_file("m.py", "X = 6\n")
        ws.run_python("import m\nopen('out.txt', 'w').write(str(m.X * 7))")
        ws.run_shell("cat out.txt")
        if hold_s:
            time.sleep(hold_s)
    return opened, 3


def workspace_rows(pool: SandboxPool, n: int) -> list[tuple[str, float, float]]:
    """Latency of a workspace's open, one call in it and its close (wipe), warm pool."""
    opens, calls, closes = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        ws = pool.workspace()
        t1 = time.perf_counter()
        ws.run_python(SNIPPET)
        t2 = time.perf_counter()
        ws.close()
        opens.append(t1 - t0)
        calls.append(t2 - t1)
        closes.append(time.perf_counter() - t2)
    return [
        ("workspace open", *percentiles(opens)),
        ("workspace call", *percentiles(calls)),
        ("workspace close", *percentiles(closes)),
    ]


def episode_throughput(pool: SandboxPool, concurrency: int, n: int) -> tuple[float, float]:
    """Episodes/s and sandbox calls/s (3 calls per episode) at this concurrency."""
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda _: episode(pool), range(concurrency * 2)))
        t0 = time.perf_counter()
        calls = sum(c for _, c in ex.map(lambda _: episode(pool), range(n)))
    elapsed = time.perf_counter() - t0
    return n / elapsed, calls / elapsed


def pool_follows_rate(pool: SandboxPool, rate: float, hold_s: float, seconds: float) -> dict:
    """Poisson arrivals of episodes at ``rate``/s, each holding its workspace ``hold_s``;
    samples sandboxes alive and compares them with Little's law (rate x time held)."""
    rng = random.Random(int(rate * 1000))
    before, alive, held, opens = pool.metrics(), [], [], []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            m = pool.metrics()
            alive.append(m["sandbox/warm"] + m["sandbox/busy"])

    def one() -> None:
        t0 = time.perf_counter()
        opened, _ = episode(pool, hold_s)
        opens.append(opened)
        held.append(time.perf_counter() - t0)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        threads.append(threading.Thread(target=one))
        threads[-1].start()
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    after = pool.metrics()
    claims = after["sandbox/claims"] - before["sandbox/claims"]
    misses = after["sandbox/buffer_misses"] - before["sandbox/buffer_misses"]
    return {
        "rate": len(threads) / seconds,
        "little": len(threads) / seconds * statistics.median(held),
        "alive_median": statistics.median(alive),
        "alive_peak": max(alive),
        "warm_target": after["sandbox/warm_target"],
        "miss_rate": misses / claims if claims else 0.0,
        "open_p50_ms": percentiles(opens)[0],
    }


def workspace_section(backend: str, n: int, rate_s: float) -> None:
    limits = SandboxLimits(timeout_s=5)
    with SandboxPool(backend, limits=limits, min_warm=2, max_warm=16, max_sandboxes=48) as pool:
        time.sleep(1.0)
        print(f"\nworkspaces (backend {pool.backend})")
        print(f"{'operation':<20} {'p50 ms':>8} {'p99 ms':>8}")
        base = ("plain pool exec", *percentiles(time_runs(lambda: pool.exec(SNIPPET), n)))
        rows = [base, *workspace_rows(pool, n)]
        for name, p50, p99 in rows:
            print(f"{name:<20} {p50:8.2f} {p99:8.2f}")
        cycle = sum(p50 for _, p50, _ in rows[1:])
        print(f"  open+call+close is {cycle / base[1]:.1f}x one plain exec at p50")
        print(f"\n{'concurrency':<12} {'episodes/s':>10} {'calls/s':>9} {'plain execs/s':>14}")
        for c in (1, 2, 4):
            eps, calls = episode_throughput(pool, c, max(20, n // 4))
            plain = throughput(pool, c, n)
            print(f"{c:<12} {eps:10.1f} {calls:9.0f} {plain:14.0f}")
    rate_section(backend, rate_s)


def rate_section(backend: str, rate_s: float) -> None:
    """A fresh pool under rising episode rates, a quiet spell past the peak window, then
    the lowest rate again: sandboxes alive should track Little's law (rate x time held)
    plus the warm buffer, up and back down."""
    limits = SandboxLimits(timeout_s=5)
    print(
        f"\n{'phase':<8} {'episodes/s':>10} {'held s':>7} {'little':>7} {'alive p50':>10} "
        f"{'peak':>5} {'warm_target':>12} {'miss':>7} {'open p50 ms':>12}"
    )
    with SandboxPool(backend, limits=limits, min_warm=2, max_warm=16, max_sandboxes=64) as pool:
        time.sleep(1.0)
        phases = [("up", 2.0, 0.5), ("up", 8.0, 0.5), ("up", 16.0, 1.0), ("down", 2.0, 0.5)]
        for phase, rate, hold in phases:
            if phase == "down":
                time.sleep(PEAK_WINDOW_S + 2.0)
            r = pool_follows_rate(pool, rate, hold, rate_s)
            print(
                f"{phase:<8} {r['rate']:10.1f} {hold:7.1f} {r['little']:7.1f} "
                f"{r['alive_median']:10.0f} {r['alive_peak']:5.0f} {r['warm_target']:12.0f} "
                f"{r['miss_rate']:7.1%} {r['open_p50_ms']:12.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--execs", type=int, default=500)
    parser.add_argument("--burst-s", type=float, default=20.0)
    parser.add_argument(
        "--workspace-only", action="store_true", help="only the per-episode workspace section"
    )
    parser.add_argument("--rate-s", type=float, default=8.0, help="seconds per arrival rate")
    args = parser.parse_args()
    if args.workspace_only:
        workspace_section(args.backend, args.execs, args.rate_s)
        return
    limits = SandboxLimits(timeout_s=5)
    with SandboxPool(args.backend, limits=limits, min_warm=2, max_warm=8, max_sandboxes=16) as pool:
        time.sleep(1.0)
        print(f"backend: {pool.backend}")
        print(f"{'start-up path':<20} {'p50 ms':>8} {'p99 ms':>8}")
        rows = latency_rows(pool, args.execs)
        for name, p50, p99 in rows:
            print(f"{name:<20} {p50:8.2f} {p99:8.2f}")
        warm = rows[0][1]
        for name, p50, _ in rows[1:]:
            print(f"  {name}: warm pool is {p50 / warm:.1f}x faster at p50")
        print(f"\n{'concurrency':<12} {'execs/s':>9}")
        for c in (1, 2, 4, 8):
            print(f"{c:<12} {throughput(pool, c, args.execs):9.0f}")
        adapting, adapted, claims = bursty_misses(pool, args.burst_s)
        print(
            f"\nbursty load ({args.burst_s:.0f}s, bursts of 1-8): miss rate while adapting "
            f"{adapting:.2%}, after adapting {adapted:.2%} of {claims} claims"
        )
        m = pool.metrics()
        print(
            f"pool: warm_target={m['sandbox/warm_target']:.0f} started={m['sandbox/started']:.0f} "
            f"ready_p95_ms={m['sandbox/ready_p95_ms']:.1f} infra_failures={m['sandbox/infra_failures']:.0f}"
        )
    workspace_section(args.backend, args.execs, args.rate_s)


if __name__ == "__main__":
    main()
