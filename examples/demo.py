"""The jaild demo: a daemon, a jailed job, two host tools called concurrently.

Run with ``make demo``. It starts ``jaild serve`` on a private socket, submits a
job whose code calls a plain (sync) host tool and an async host tool together
with ``asyncio.gather``, prints as it goes and returns a value; then it shows
the result record and stops the daemon with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from jaild import Client

PRICES = {"apple": 0.5, "pear": 0.75, "fig": 2.0}


def price(item: str) -> float:
    """Price of one item, in euros (a plain function: runs in a worker thread)."""
    return PRICES[item]


async def stock(item: str) -> int:
    """Units in stock (an async function: runs on the client's event loop)."""
    await asyncio.sleep(0.05)
    return {"apple": 12, "pear": 0, "fig": 3}[item]


JOB = """
import asyncio

basket = ["apple", "pear", "fig"]
prices, stocks = await asyncio.gather(
    asyncio.gather(*(tools.price(item) for item in basket)),
    asyncio.gather(*(tools.stock(item=item) for item in basket)),
)
for item, p, s in zip(basket, prices, stocks):
    print(f"{item:6} {p:5.2f} EUR  {s:3d} in stock")
available = {item: p for item, p, s in zip(basket, prices, stocks) if s > 0}
{"available": available, "total": sum(available.values())}
"""


READY_WAIT_S = 900.0
"""How long the daemon may take to start: its policies' self-tests run first, which takes a
second or two here and far longer on an emulated machine (the CI guest runs this demo under
QEMU's TCG). The daemon says when it serves; this bounds only a daemon that hangs."""


def wait_until_ready(notify: socket.socket, proc: subprocess.Popen[bytes]) -> None:
    """Wait for the daemon's ``READY=1`` (sd_notify, on the datagram socket it was given as
    ``$NOTIFY_SOCKET``): it is sent once every policy has passed its self-test and the
    socket serves -- a signal, not a guess at how long starting takes."""
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"demo: jaild exited early with status {proc.returncode}")
        notify.settimeout(0.5)
        try:
            message = notify.recv(4096)
        except TimeoutError:
            continue
        if b"READY=1" in message.split(b"\n"):
            return
    sys.exit(f"demo: jaild did not say it was ready within {READY_WAIT_S:g} s")


class Prefixed:
    """Prints a stream's chunks with ``prefix`` at the start of every line (a chunk may end
    mid-line, or hold several lines)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.at_line_start = True

    def __call__(self, text: str) -> None:
        out = []
        for line in text.splitlines(keepends=True):
            out.append((self.prefix if self.at_line_start else "") + line)
            self.at_line_start = line.endswith("\n")
        print("".join(out), end="", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="jaild-demo-") as tmp:
        sock = os.path.join(tmp, "jaild.sock")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(tmp, "notify.sock"))
        print(f"== starting jaild serve --socket {sock}")
        daemon = subprocess.Popen([sys.executable, "-m", "jaild", "serve", "--socket", sock],
                                  env={**os.environ,
                                       "NOTIFY_SOCKET": os.path.join(tmp, "notify.sock")})
        try:
            wait_until_ready(notify, daemon)
            print("== running a job that calls two host tools (one sync, one async) concurrently")
            with Client(sock) as client:
                result = client.run(
                    JOB,
                    policy="default",
                    tools={"price": price, "stock": stock},
                    timeout=10,
                    on_stdout=Prefixed("   jail| "),
                )
            print("== result record")
            print(json.dumps(result.to_dict(), indent=2))
        finally:
            print("== stopping the daemon (SIGTERM)")
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=30)
            notify.close()
        print(f"== daemon exited with status {code}; socket removed: {not os.path.exists(sock)}")
        ok = result.status == "ok" and result.result["total"] == 2.5 and code == 0
        print("== demo", "OK" if ok else "FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
