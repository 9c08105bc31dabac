"""Sandbox benchmark: warm-pool exec latency against cold starts, throughput, buffer misses.

    .venv/bin/python bench/sandbox.py [--backend auto] [--execs 500] [--burst-s 20]

Prints, in one run: exec latency p50/p99 of ``print(1)`` from the warm pool next to a cold
``bwrap`` start and a plain ``subprocess`` start of the same snippet; executions per
second at concurrency 1, 2, 4, 8; and the buffer miss rate under a bursty load, before
and after the warm buffer has adapted. Goals: warm p50 <= 5 ms, p99 <= 20 ms,
>= 200 execs/s on a 2-core machine, misses < 1% once adapted.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from loomrl.sandbox import SandboxLimits, SandboxPool
from loomrl.sandbox.backends import bwrap_launch, bwrap_path, sandbox_python

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--execs", type=int, default=500)
    parser.add_argument("--burst-s", type=float, default=20.0)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
