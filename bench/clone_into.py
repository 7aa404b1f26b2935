"""What ``daemon.clone_into_cgroup`` does to a fresh jail, on cgroup v2 (issue 45, item 5).

Two private daemons of this checkout, alike but for the setting: ``false``, a zygote forks
each jail into its own cgroup and the daemon moves it into its job's (a worker thread's
write to ``cgroup.procs``, then the go byte the jail waits for); ``true`` (the default), the
zygote forks it straight into its job's cgroup with ``clone3(CLONE_INTO_CGROUP)``. Each pair
runs as section 13 of ``bench/compare.py`` runs a lever -- flat out at 16 clients, taking
turns, the whole machine's CPU per job from ``/proc/stat`` -- and then one job at a time
(call to result, medians of ``--runs``), for a warm daemon (a pool of 4-8 jails made ahead)
and a cold one (every jail made for its job: the move is then on the job's path).

Only on a cgroup v2 host (``clone3`` into a cgroup is v2's); here, the Debian 12 guest::

    make test-hosts HOSTS_ARGS="--profile ci --steps clone test --target setup \
        --tests hosts/bench_clone_in_guest.py"

    .venv/bin/python bench/clone_into.py [--rounds 3] [--seconds 4] [--runs 60] [--out F.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import variants
from jaildrun import PrivateDaemon, Variant
from measure import Throughput
from report import BREAKDOWN_CLIENTS


def _pair(base: Variant) -> tuple[Variant, Variant]:
    return (dataclasses.replace(base, key=f"{base.key}_moved", clone_into_cgroup=False),
            dataclasses.replace(base, key=f"{base.key}_cloned"))


def measure(kind: str, base: Variant, rounds: int, seconds: float, runs: int
            ) -> dict[str, dict[str, float]]:
    """``kind``'s two daemons: jobs/s and CPU per job flat out, latency one at a time."""
    off, on = _pair(base)
    flat: dict[str, list[Throughput]] = {"moved": [], "cloned": []}
    lat: dict[str, list[float]] = {"moved": [], "cloned": []}
    with PrivateDaemon(off) as d_off, PrivateDaemon(on) as d_on:
        for _ in range(rounds):
            for side, daemon in (("moved", d_off), ("cloned", d_on)):
                t = daemon.throughput(BREAKDOWN_CLIENTS, seconds)
                if t.failures:
                    raise RuntimeError(f"{kind}/{side}: {t.failures} failed: {t.first_failure}")
                flat[side].append(t)
                print(f"{kind} {side}: {t.jobs / t.seconds:.1f} jobs/s", flush=True)
            for side, daemon in (("moved", d_off), ("cloned", d_on)):
                lat[side] += daemon.latency(runs).samples_s
    out: dict[str, dict[str, float]] = {}
    for side in ("moved", "cloned"):
        ts = flat[side]
        out[side] = {
            "jobs_per_s": sum(t.jobs for t in ts) / sum(t.seconds for t in ts),
            "cpu_per_job_ms": 1e3 * sum(t.cpu_s or 0.0 for t in ts) / sum(t.jobs for t in ts),
            "p50_ms": 1e3 * statistics.median(lat[side]),
            "jobs": sum(t.jobs for t in ts),
        }
    return out


def render(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        "# `daemon.clone_into_cgroup`: moved after the fork (false) against born in the "
        "job's cgroup (true)",
        "",
        f"`{' '.join(['bench/clone_into.py', *sys.argv[1:]])}` on {os.uname().release}; "
        f"{args.rounds} rounds of {args.seconds:g} s flat out at {BREAKDOWN_CLIENTS} clients "
        f"a side, taking turns, and {args.runs} jobs one at a time a side per round.",
        "",
        "| daemon | jobs/s moved | jobs/s cloned | ratio | CPU per job moved / cloned "
        "| ratio | p50 moved / cloned | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, r in results.items():
        m, c = r["moved"], r["cloned"]
        lines.append(
            f"| {kind} | {m['jobs_per_s']:.1f} | {c['jobs_per_s']:.1f} | "
            f"{c['jobs_per_s'] / m['jobs_per_s']:.2f}x | {m['cpu_per_job_ms']:.1f} / "
            f"{c['cpu_per_job_ms']:.1f} ms | {c['cpu_per_job_ms'] / m['cpu_per_job_ms']:.2f}x | "
            f"{m['p50_ms']:.1f} / {c['p50_ms']:.1f} ms | {c['p50_ms'] / m['p50_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        print("not a cgroup v2 host: clone3 into a cgroup is v2's", file=sys.stderr)
        return 2
    kinds = {v.key: v for v in variants(True)}
    results = {kind: measure(kind, kinds[kind], args.rounds, args.seconds, args.runs)
               for kind in ("warm", "cold")}
    text = render(results, args)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
