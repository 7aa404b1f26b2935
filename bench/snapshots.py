"""Section 11: what a session's snapshot costs -- taking it, restoring it, forking, pausing.

Measured on a private daemon per kind of session (a small one and one built by 20 runs under
the default policy; one with numpy and pandas loaded under the data policy), side by side
with the alternatives the choice of mechanism was made against, in the same run:

* ``fresh``: opening a fresh session (a jail made for it): what any restore pays at least;
* ``replay``: a fresh session that runs the code that built the state again -- what the
  replay-journal mechanism pays to restore (its cost grows with the session's history, and
  it is only right if the code is deterministic);
* ``restore``: opening a session from the snapshot (a fresh jail, the state unpickled in it).

The peers' own figures are published ones (E2B: about 4 s per GiB of memory to pause, about
1 s to resume); CRIU is not measured: ``criu check`` fails on this host's kernel (docs).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from jaildrun import PrivateDaemon, Variant
from measure import BenchError, Latency

SMALL = (
    "import json, random\nrandom.seed(1)\n"
    "items = [{'i': i, 's': str(i)} for i in range(2000)]\n"
    "def double(x):\n    return 2 * x\n"
    "class Box:\n    def __init__(self, v):\n        self.v = v\n"
    "box = Box(items[:10])\n"
)
DATA = (
    "import numpy as np, pandas as pd\n"
    "a = np.random.default_rng(1).random((200, 200))\n"
    "df = pd.DataFrame({'x': range(5000), 'y': [str(i) for i in range(5000)]})\n"
    "summary = df.describe()\n"
)
HISTORY_RUNS = 20
HISTORY = ["acc = []"] + [f"acc.append(sum(i * i for i in range({k}, 300_000)))"
                          for k in range(HISTORY_RUNS - 1)]
"""A session built by 20 runs of a little work each (a tenth of a second or so): its state
is small, its history long -- what a replay must run again, every time."""
CHECK = {"small": ("len(items) + double(1)", 2002), "data": ("int(df['x'].sum())", 12497500),
         "history": ("len(acc)", HISTORY_RUNS - 1)}
BUILDS: dict[str, list[str]] = {"small": [SMALL], "data": [DATA], "history": HISTORY}
FORKS = 8


@dataclass
class SnapshotCosts:
    """One kind of session's figures (seconds per operation, client to answer)."""

    bytes: int
    snapshot: Latency
    restore: Latency
    fresh: Latency
    replay: Latency
    fork: Latency
    """``fork(FORKS)``: a snapshot and FORKS restores, concurrently."""
    pause: Latency
    resume: Latency
    """A paused session's next run, its resume included (minus a warm run: the resume)."""


async def _measure(daemon: PrivateDaemon, build: list[str], check: tuple[str, object],
                   runs: int) -> SnapshotCosts:
    policy = daemon.policy
    samples: dict[str, list[float]] = {k: [] for k in
                                       ("snapshot", "restore", "fresh", "replay", "fork",
                                        "pause", "resume")}
    size = 0
    async with daemon.async_client() as c, c.session(policy) as origin:
        for code in build:
            r = await origin.run(code)
            if r.status != "ok":
                raise BenchError(f"building the session: {r.status} {r.error}")
        for _ in range(runs):
            t = time.perf_counter()
            entry = await origin.snapshot(ttl_s=600)
            samples["snapshot"].append(time.perf_counter() - t)
            size = entry["bytes"]
            t = time.perf_counter()
            async with c.restore(entry["id"], policy=policy) as s:
                samples["restore"].append(time.perf_counter() - t)
                got = (await s.run(check[0])).result
                if got != check[1]:
                    raise BenchError(f"restored state: {got!r}, not {check[1]!r}")
            await c.delete_snapshot(entry["id"])
            t = time.perf_counter()
            async with c.session(policy) as s:
                samples["fresh"].append(time.perf_counter() - t)
                for code in build:
                    r = await s.run(code)
                    if r.status != "ok":
                        raise BenchError(f"replaying: {r.status} {r.error}")
                samples["replay"].append(time.perf_counter() - t)
            t = time.perf_counter()
            forks = await origin.fork(FORKS)
            samples["fork"].append(time.perf_counter() - t)
            await asyncio.gather(*(f.close() for f in forks))
            t = time.perf_counter()
            await origin.pause()
            samples["pause"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await origin.run("1")
            resumed = time.perf_counter() - t
            t = time.perf_counter()
            await origin.run("1")
            samples["resume"].append(max(0.0, resumed - (time.perf_counter() - t)))
    return SnapshotCosts(size, *(Latency(samples[k]) for k in
                                 ("snapshot", "restore", "fresh", "replay", "fork", "pause",
                                  "resume")))


def measure(kind: str, variant: Variant, runs: int) -> SnapshotCosts:
    """``kind`` (``small``, ``data``, ``history``): its figures over ``runs`` rounds."""
    with PrivateDaemon(variant) as daemon:
        return asyncio.run(_measure(daemon, BUILDS[kind], CHECK[kind], runs))


E2B_PAUSE_S_PER_GIB = 4.0
E2B_RESUME_S = 1.0
"""E2B's published figures (e2b.dev/docs/sandbox/persistence): pausing takes about 4 s per
GiB of the sandbox's memory, resuming about 1 s. A microVM's whole memory, not a session's
state: so a different thing, beside ours only as the figure a user of a peer would meet."""

__all__ = ["BUILDS", "E2B_PAUSE_S_PER_GIB", "E2B_RESUME_S", "FORKS", "HISTORY_RUNS",
           "SnapshotCosts", "measure"]
