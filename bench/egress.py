"""The egress gateway against mitmproxy, side by side (``make bench-egress``).

jaild's door (:class:`jaild.daemon.egress.gateway.EgressDoor`) and ``mitmdump`` each run in a
process of their own, in front of the same local upstream, and one client measures, in
alternating rounds:

* a plain-HTTP absolute-form ``GET`` through the proxy (one connection per request, as the
  door serves them): latency p50 and p90;
* ``CONNECT`` and a request inside the tunnel, untouched (mitmdump with
  ``--ignore-hosts '.*'``: it passes every tunnel through, as the door does for hosts
  without injection): latency p50 and p90;
* one 64 MiB body through a tunnel: throughput;
* the proxy's RSS after all that.

The table gives each figure and mitmdump's as a ratio of the door's. mitmproxy is not a
dependency of jaild: ``make bench-egress`` installs it into a venv of its own.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIG = 64 << 20
REPO = Path(__file__).resolve().parents[1]

UPSTREAM = r'''
import asyncio, sys
BIG = int(sys.argv[2])
SMALL = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
async def serve(r, w):
    head = await r.readuntil(b"\r\n\r\n")
    if b" /big " in head:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % BIG)
        chunk = b"x" * 65536
        for _ in range(BIG // 65536):
            w.write(chunk)
            await w.drain()
    else:
        w.write(SMALL)
    await w.drain()
    w.close()
async def main():
    s = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    print("up", flush=True)
    await s.serve_forever()
asyncio.run(main())
'''

DOOR = r'''
import asyncio, socket, sys
from jaild.daemon.egress.gateway import EgressDoor, EgressQuota
from jaild.policy.egress import EgressRules
async def main():
    rules = EgressRules.parse([f"127.0.0.1:{sys.argv[2]}"], deny_private=False)
    door = EgressDoor(rules, EgressQuota(10**9, 1 << 50), "bench")
    listener = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=128)
    print("up", flush=True)
    await door.serve(listener)
asyncio.run(main())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(argv: list[str], ready: bool = True) -> subprocess.Popen[str]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=REPO)
    if ready:
        assert p.stdout is not None
        line = p.stdout.readline()
        if "up" not in line:
            p.kill()
            raise RuntimeError(f"{argv[0]} did not start: {line}")
    return p


def wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def recv_all(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 20):
        out += chunk
    return bytes(out)


def plain(proxy: int, up: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", proxy)) as s:
        s.sendall(f"GET http://127.0.0.1:{up}/ HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = recv_all(s)
    if not data.endswith(b"ok"):
        raise RuntimeError(f"unexpected answer: {data[:200]!r}")
    return time.perf_counter() - t


def tunnel(proxy: int, up: int, path: str = "/") -> tuple[float, int]:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", proxy)) as s:
        s.sendall(f"CONNECT 127.0.0.1:{up} HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError(f"closed after {head!r}")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"CONNECT refused: {head[:200]!r}")
        rest = head.split(b"\r\n\r\n", 1)[1]
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\nConnection: close\r\n\r\n"
                  .encode())
        data = rest + recv_all(s)
    return time.perf_counter() - t, len(data)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(port: int, up: int, pid: int, n: int) -> dict[str, float]:
    for _ in range(20):
        plain(port, up)
        tunnel(port, up)
    p = sorted(plain(port, up) for _ in range(n))
    c = sorted(tunnel(port, up)[0] for _ in range(n))
    t0 = time.perf_counter()
    _, size = tunnel(port, up, "/big")
    elapsed = time.perf_counter() - t0
    if size < BIG:
        raise RuntimeError(f"the 64 MiB body came back as {size} bytes")
    return {
        "plain_p50_ms": p[n // 2] * 1e3, "plain_p90_ms": p[int(n * 0.9)] * 1e3,
        "tunnel_p50_ms": c[n // 2] * 1e3, "tunnel_p90_ms": c[int(n * 0.9)] * 1e3,
        "tunnel_MB_s": BIG / elapsed / 1e6, "rss_MB": rss_mb(pid),
    }


ROWS = [
    ("plain_p50_ms", "plain HTTP request, p50 (ms)"),
    ("plain_p90_ms", "plain HTTP request, p90 (ms)"),
    ("tunnel_p50_ms", "CONNECT + request, p50 (ms)"),
    ("tunnel_p90_ms", "CONNECT + request, p90 (ms)"),
    ("tunnel_MB_s", "64 MiB through a tunnel (MB/s)"),
    ("rss_MB", "proxy RSS after the run (MB)"),
]


def report(door: list[dict[str, float]], mitm: list[dict[str, float]], n: int,
           mitmdump: str) -> str:
    version = subprocess.run([mitmdump, "--version"], capture_output=True, text=True,
                             check=False).stdout.split("\n", 1)[0]
    lines = [
        f"# The egress door against mitmdump ({version}; {n} requests per figure, "
        f"{len(door)} alternating rounds, medians of the rounds)",
        "",
        "| | jaild door | mitmdump | mitmdump / door |",
        "|---|---|---|---|",
    ]
    for key, label in ROWS:
        a = statistics.median(r[key] for r in door)
        b = statistics.median(r[key] for r in mitm)
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mitmdump", required=True, help="the mitmdump executable")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    conf = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaild-bench-mitm-{os.getpid()}"
    up = free_port()
    upstream = start([sys.executable, "-c", UPSTREAM, str(up), str(BIG)])
    door_runs: list[dict[str, float]] = []
    mitm_runs: list[dict[str, float]] = []
    try:
        for _ in range(args.rounds):
            port = free_port()
            door = start([sys.executable, "-c", DOOR, str(port), str(up)])
            try:
                door_runs.append(measure(port, up, door.pid, args.requests))
            finally:
                door.kill()
                door.wait()
            port = free_port()
            mitm = start([args.mitmdump, "-q", "--listen-host", "127.0.0.1", "--listen-port",
                          str(port), "--ignore-hosts", ".*", "--set", f"confdir={conf}"],
                         ready=False)
            try:
                wait_port(port)
                mitm_runs.append(measure(port, up, mitm.pid, args.requests))
            finally:
                mitm.kill()
                mitm.wait()
    finally:
        upstream.kill()
        upstream.wait()
    text = report(door_runs, mitm_runs, args.requests, args.mitmdump)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
