"""A client's first tool call against its later ones, as a new user meets them.

Each sample is a fresh Python process (lazy imports and first uses are per process): it
connects a client to a private daemon (the shipped default policy and its warm pool), runs
a job that makes ``CALLS`` tool calls and times each inside the job (``time.perf_counter``
around the call), then runs a second such job on the same client. Two kinds of client:

* ``blocking``: :class:`jaild.Client` with a plain synchronous handler (the README's), the
  job's calls plain synchronous ones;
* ``async``: :class:`jaild.AsyncClient` with an ``async`` handler, the job's calls awaited.

Each kind gets a fresh daemon: its first sample is a new user's very first client (what the
daemon does once, on its first job with tools, falls there), printed on a row of its own;
the next row has the medians of the other samples. Columns: the first job's first call,
its later calls back to back, its call after a 20 ms pause, the second job's first call, and
the client's wall time for each job.

Run: ``.venv/bin/python bench/first_call.py [--samples N]`` (root: it starts the daemons;
``--socket`` uses a running one instead, every sample then a later client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = 5
PAUSE_S = 0.02
SYNC_JOB = (
    "import time\n"
    "times = []\n"
    f"for i in range({CALLS + 1}):\n"
    f"    if i == {CALLS}:\n"
    f"        time.sleep({PAUSE_S})\n"
    "    t = time.perf_counter()\n"
    "    assert tools.add(a=i, b=1) == i + 1\n"
    "    times.append(time.perf_counter() - t)\n"
    "times\n"
)
"""``CALLS`` calls back to back, then one more after a pause: the first call comes after the
client and the daemon waited (for the job to start), as that last one does, and a wait
alone makes the next call slower (cold caches; an idle CPU woken; ``bench/floors.py``'s
third floor). The first call is compared with both."""
ASYNC_JOB = SYNC_JOB.replace("tools.add", "await tools.add")


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def add_async(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


TOOLS = {"add": add}
ASYNC_TOOLS = {"add": add_async}


def _job(result: Any) -> list[float]:
    if result.status != "ok":
        raise SystemExit(f"the job failed: {result.status} {result.error} {result.stderr}")
    return [float(t) for t in result.result]


def _blocking(socket: str, policy: str) -> dict[str, Any]:
    from jaild import Client

    with Client(socket) as client:
        t = time.perf_counter()
        first = _job(client.run(SYNC_JOB, policy=policy, tools=TOOLS, timeout=20))
        first_wall = time.perf_counter() - t
        t = time.perf_counter()
        second = _job(client.run(SYNC_JOB, policy=policy, tools=TOOLS, timeout=20))
        second_wall = time.perf_counter() - t
    return {"first": first, "second": second, "first_wall": first_wall,
            "second_wall": second_wall}


async def _async(socket: str, policy: str) -> dict[str, Any]:
    from jaild import AsyncClient

    async with AsyncClient(socket) as client:
        t = time.perf_counter()
        first = _job(await client.run(ASYNC_JOB, policy=policy, tools=ASYNC_TOOLS, timeout=20))
        first_wall = time.perf_counter() - t
        t = time.perf_counter()
        second = _job(await client.run(ASYNC_JOB, policy=policy, tools=ASYNC_TOOLS, timeout=20))
        second_wall = time.perf_counter() - t
    return {"first": first, "second": second, "first_wall": first_wall,
            "second_wall": second_wall}


def _sample(kind: str, socket: str, policy: str) -> dict[str, Any]:
    """One fresh process's figures for ``kind``."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, socket, policy],
                         capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {kind} sample failed: {out.stderr[-2000:]}")
    sample: dict[str, Any] = json.loads(out.stdout)
    return sample


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10, help="fresh processes per kind")
    parser.add_argument("--socket", help="an existing daemon's socket (default: start one)")
    parser.add_argument("--policy", default="default", help="with --socket: the policy to use")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, socket, policy = args.child
        sample = (_blocking(socket, policy) if kind == "blocking"
                  else asyncio.run(_async(socket, policy)))
        print(json.dumps(sample))
        return
    kinds = ("blocking", "async")
    _header(args.samples)
    if args.socket:
        for kind in kinds:
            _report(kind, args.socket, args.policy, args.samples, fresh=False)
        return
    from jaildrun import PrivateDaemon, Variant

    for kind in kinds:
        with PrivateDaemon(Variant("first-call", "first tool call", None, keep_pool=True)) as d:
            _report(kind, d.socket, d.policy, args.samples, fresh=True)


def _header(samples: int) -> None:
    print(f"{'client':30} {'1st call':>10} {'later calls':>11} {'after pause':>11} "
          f"{'2nd job 1st':>11} {'1st job':>10} {'2nd job':>10}")


def _row(label: str, figures: list[dict[str, Any]]) -> None:
    first = [f["first"][0] for f in figures]
    later = [t for f in figures for t in f["first"][1:CALLS]]
    paused = [f["first"][CALLS] for f in figures]
    again = [f["second"][0] for f in figures]
    print(f"{label:30} {_ms(first):>10} {_ms(later):>11} {_ms(paused):>11} {_ms(again):>11} "
          f"{_ms([f['first_wall'] for f in figures]):>10} "
          f"{_ms([f['second_wall'] for f in figures]):>10}")


def _report(kind: str, socket: str, policy: str, samples: int, fresh: bool) -> None:
    figures = [_sample(kind, socket, policy) for _ in range(samples)]
    if fresh:
        _row(f"{kind}, a new daemon's 1st", figures[:1])
        figures = figures[1:]
    _row(f"{kind}, median of {len(figures)} more", figures)


if __name__ == "__main__":
    main()
