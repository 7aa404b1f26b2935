"""This checkout's warm path beside another revision's, in one run: is a change no slower?

Two private daemons serve the same warm variant (zygote, pool of 4-8, the data policy as the
benchmark ships it): one runs this checkout's package, the other a git revision's (checked
out into a temporary worktree and put first on the daemon's ``PYTHONPATH``). One client per
daemon, both connected at once, take turns job by job in a shuffled order
(:func:`jaildrun.alternating_latency`), so both see the same moments of the machine. Then the
same for a run in an open session of each. The client is this checkout's (both daemons must
speak its protocol version).

Usage: python bench/ab.py [--base REV] [--runs N] [--out FILE.md]

It prints a Markdown table (median and p99 of each, and the ratio this / base) and writes it
to ``--out`` if given. ``make bench-ab`` runs it against ``BASE`` (default: ``HEAD~1``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from jaildrun import JAILD_CODE, REPO, PrivateDaemon, Variant, alternating_latency
from measure import Latency

from jaild.client import AsyncClient


def base_entry(tree: Path) -> tuple[str, ...]:
    """How Python starts a daemon of the package checked out at ``tree``: that package first
    on ``sys.path``. (``PYTHONPATH`` alone is not enough: ``python -m jaild``, started in this
    checkout, puts its working directory -- this checkout's package -- before it.)"""
    return ("-c", f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
                  "runpy.run_module('jaild', run_name='__main__', alter_sys=True)")


def worktree(rev: str, into: Path) -> str:
    """``rev`` checked out at ``into``; its commit, short."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), rev],
                   check=True, capture_output=True)
    out = subprocess.run(["git", "-C", str(into), "rev-parse", "--short", "HEAD"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


async def _session_turns(ends: dict[str, PrivateDaemon], runs: int,
                         warmup: int = 2) -> dict[str, Latency]:
    samples: dict[str, list[float]] = {key: [] for key in ends}
    order = random.Random(0)
    async with AsyncExitStack() as stack:
        sessions = {}
        for key, daemon in ends.items():
            client: AsyncClient = await stack.enter_async_context(daemon.async_client("unix"))
            sessions[key] = await stack.enter_async_context(client.session(daemon.policy))
        turns = list(sessions.items())
        for i in range(warmup + runs):
            order.shuffle(turns)
            for key, session in turns:
                started = time.perf_counter()
                result = await session.run(JAILD_CODE)
                if result.status != "ok" or result.result != 2:
                    raise RuntimeError(f"{key}: session run {result.status}: {result.error}")
                if i >= warmup:
                    samples[key].append(time.perf_counter() - started)
    return {key: Latency(s) for key, s in samples.items()}


def table(rows: dict[str, dict[str, Latency]], base: str) -> str:
    lines = [f"| path | this: median / p99 (ms) | {base}: median / p99 (ms) | ratio of medians |",
             "|---|---:|---:|---:|"]
    for name, ends in rows.items():
        this, other = ends["this"], ends["base"]
        lines.append(
            f"| {name} | {this.median_s * 1e3:.2f} / {this.p99_s * 1e3:.2f} | "
            f"{other.median_s * 1e3:.2f} / {other.p99_s * 1e3:.2f} | "
            f"{this.median_s / other.median_s:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1", help="the revision to compare with")
    p.add_argument("--runs", type=int, default=500, help="timed jobs per path and end")
    p.add_argument("--pause-s", type=float, default=0.020,
                   help="between one-shot jobs, so the pool refills (the benchmark's 20 ms)")
    p.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaild-ab-") as tmp:
        tree = Path(tmp) / "base"
        try:
            base = worktree(args.base, tree)
            this = Variant("ab_this", "this checkout, warm", "zygote", 4, 8)
            other = Variant("ab_base", f"{base}, warm", "zygote", 4, 8,
                            env=(("PYTHONPATH", str(tree)),))
            with PrivateDaemon(this) as mine, PrivateDaemon(other, base_entry(tree)) as theirs:
                rows = {
                    "warm one-shot job": alternating_latency(
                        {"this": (mine, "unix"), "base": (theirs, "unix")}, args.runs,
                        args.pause_s),
                    "a run in an open session": asyncio.run(
                        _session_turns({"this": mine, "base": theirs}, args.runs)),
                }
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)
    text = (f"Warm path, this checkout beside {base} ({args.runs} jobs each, taking turns; "
            f"{args.pause_s * 1e3:g} ms between one-shot jobs):\n\n"
            + table(rows, base) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
