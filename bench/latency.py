"""Job latency side by side: in-process exec, bare python, bare nsjail+python, jaild.

``make bench`` runs this and writes ``bench/report.md``. Each figure is the
median and p99 of N sequential runs of trivial code (``result = 1 + 1``), from
"call" to "result in hand", measured in one run on this machine; ratios are
against the same run's floor (in-process exec) and bare nsjail+python.

Usage: python bench/latency.py [--runs N] [--quick] [--out bench/report.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaild.client import Client  # noqa: E402
from jaild.staging import locate_nsjail  # noqa: E402

CODE = "result = 1 + 1"
JAIL_PYTHON = "/var/lib/jaild/envs/default/bin/python3"


def measure(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def in_process() -> object:
    ns: dict[str, object] = {}
    exec(compile(CODE, "<job>", "exec"), ns)
    return ns["result"]


def bare_python() -> object:
    return subprocess.run([JAIL_PYTHON, "-I", "-c", CODE], check=True)


def bare_nsjail(nsjail: str) -> Callable[[], object]:
    argv = [
        nsjail, "-Mo", "-Q", "--user", "65534:1073741823:1", "--group", "65534:1073741823:1",
        "--disable_proc", "-R", "/usr", "-R", "/var/lib/jaild/envs/default:/opt/env",
        "-s", "usr/lib:/lib", "-s", "usr/lib64:/lib64", "-s", "usr/bin:/bin",
        "--", "/opt/env/bin/python3", "-I", "-c", CODE,
    ]
    return lambda: subprocess.run(argv, check=True)


def start_daemon(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = os.path.join(tmp, "bench.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaild", "serve", "--socket", sock, "--log-level", "warning"],
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(sock)
                return proc, sock
            except OSError:
                time.sleep(0.05)
    raise SystemExit("jaild did not start")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a few runs: keeps the bench working")
    parser.add_argument("--out", default=str(REPO / "bench" / "report.md"))
    args = parser.parse_args()
    runs = 5 if args.quick else args.runs
    nsjail = locate_nsjail(None)
    rows: list[tuple[str, list[float]]] = []
    rows.append(("in-process exec (floor)", measure(in_process, runs)))
    rows.append(("python subprocess per job (no isolation)", measure(bare_python, runs)))
    rows.append(("bare nsjail + python per job", measure(bare_nsjail(nsjail), runs)))
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(tmp)
        try:
            with Client(sock) as c:
                def job() -> object:
                    r = c.run("1 + 1")
                    assert r.status == "ok" and r.result == 2, r
                    return r

                rows.append(("jaild job, fresh jail (cold path)", measure(job, runs)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    floor = statistics.median(rows[0][1])
    nsj = statistics.median(rows[2][1])
    lines = [
        "# jaild latency benchmark",
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}. {runs} sequential runs each, one run of this script.",
        "",
        "| what | median | p99 | x floor | x bare nsjail |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, xs in rows:
        med = statistics.median(xs)
        lines.append(
            f"| {name} | {med * 1e3:.2f} ms | {p99(xs) * 1e3:.2f} ms | {med / floor:,.0f} | "
            f"{med / nsj:.2f} |"
        )
    report = "\n".join(lines) + "\n"
    Path(args.out).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
