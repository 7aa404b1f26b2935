"""Soak: thousands of jobs through one daemon, with zero lost results and flat resources.

``make soak`` (not part of ``make test``): 5,000 sequential jobs, then 40 bursts of 200
concurrent ones, then 400 sessions of 10 runs each (16 open at once), against one
``jaild serve``. Every result must come back ``ok`` with
the right value, and the daemon's RSS and descriptor count must stay flat: across the
sequential jobs (after a warm-up of 100), and over the second half of the bursts (the first
bursts raise the high-water mark -- Python keeps freed arenas -- then it must hold).

The sessions must leave nothing either: RSS over their second half and descriptors flat.

The bursts' RSS climbs to a high-water mark over the first ~20 (8,000 jobs had it still rising
with 8 bursts; tracemalloc over those bursts shows no Python object left behind) and must then
hold: 40 bursts are judged on their second half.

Usage: python bench/soak.py [--sequential 5000] [--bursts 40] [--burst-size 200] [--sessions 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaild.client import AsyncClient, Client  # noqa: E402
from tests.conftest import wait_listening  # noqa: E402


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def burst(sock: str, size: int, offset: int) -> int:
    async with AsyncClient(sock) as c:
        results = await asyncio.gather(*(c.run(f"{offset + i} * 2") for i in range(size)))
    lost = [r for i, r in enumerate(results) if r.status != "ok" or r.result != (offset + i) * 2]
    for r in lost[:5]:
        print(f"  LOST: {r.status} {r.error}")
    return len(lost)


async def sessions(sock: str, count: int, runs: int) -> int:
    """``count`` sessions of ``runs`` runs each, 16 at a time; how many results were wrong."""
    gate = asyncio.Semaphore(16)

    async def one(n: int) -> int:
        async with gate, AsyncClient(sock) as c, c.session() as s:
            await s.run(f"total = {n}")
            bad = 0
            for i in range(1, runs):
                r = await s.run(f"total += {i}\ntotal")
                bad += r.status != "ok" or r.result != n + i * (i + 1) // 2
            return bad

    return sum(await asyncio.gather(*(one(n) for n in range(count))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequential", type=int, default=5000)
    parser.add_argument("--bursts", type=int, default=40)
    parser.add_argument("--burst-size", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "soak.sock")
        log = os.path.join(tmp, "jaild.log")
        with open(log, "wb") as out:
            command = [sys.executable, "-m", "jaild", "serve", "--socket", sock,
                       "--log-level", "warning"]
            proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_listening(sock, proc, log)
            lost = 0
            started = time.monotonic()
            with Client(sock) as c:
                for i in range(args.sequential):
                    r = c.run(f"{i} + 1")
                    if r.status != "ok" or r.result != i + 1:
                        lost += 1
                        print(f"  LOST job {i}: {r.status} {r.error}")
                    if i == 1000:  # steady state: the warm pool has grown to what it needs
                        base_rss, base_fds = rss_kb(proc.pid), fds(proc.pid)
                    if i and i % 1000 == 0:
                        print(f"{i} jobs, {time.monotonic() - started:.0f} s, "
                              f"rss {rss_kb(proc.pid)} kB, fds {fds(proc.pid)}")
            seq_rss, seq_fds = rss_kb(proc.pid), fds(proc.pid)
            print(f"sequential: {args.sequential} jobs in {time.monotonic() - started:.0f} s, "
                  f"{lost} lost; rss {base_rss} -> {seq_rss} kB, fds {base_fds} -> {seq_fds}")
            burst_rss = []
            for b in range(args.bursts):
                t = time.monotonic()
                n = asyncio.run(burst(sock, args.burst_size, b * args.burst_size))
                lost += n
                time.sleep(0.5)
                burst_rss.append(rss_kb(proc.pid))
                print(f"burst {b + 1}: {args.burst_size} concurrent jobs in "
                      f"{time.monotonic() - t:.1f} s, {n} lost; rss {burst_rss[-1]} kB, "
                      f"fds {fds(proc.pid)}")
            end_fds = fds(proc.pid)
            session_rss = []
            t = time.monotonic()
            for part in range(4):
                n = asyncio.run(sessions(sock, args.sessions // 4, 10))
                lost += n
                time.sleep(0.5)
                session_rss.append(rss_kb(proc.pid))
                print(f"sessions {part + 1}/4: {args.sessions // 4} sessions of 10 runs, {n} "
                      f"lost; rss {session_rss[-1]} kB, fds {fds(proc.pid)}")
            print(f"sessions: {args.sessions} in {time.monotonic() - t:.0f} s")
            session_fds = fds(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    seq_growth = (seq_rss - base_rss) / base_rss
    half = len(burst_rss) // 2  # the first bursts raise the high-water mark, then it must hold
    burst_growth = (burst_rss[-1] - burst_rss[half]) / burst_rss[half]
    session_growth = (session_rss[-1] - session_rss[1]) / session_rss[1]
    print(f"daemon rss over the sequential jobs: {seq_growth:+.1%}; over the second half of "
          f"the bursts: {burst_growth:+.1%}; over the second half of the sessions: "
          f"{session_growth:+.1%}; fds {base_fds} -> {end_fds} -> {session_fds}")
    ok = (lost == 0 and seq_fds <= base_fds and end_fds <= base_fds
          and session_fds <= base_fds and seq_growth < 0.05 and burst_growth < 0.05
          and session_growth < 0.05 and proc.returncode == 0)
    print("soak:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
