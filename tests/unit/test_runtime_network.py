"""The runtime's refusal of network attempts (jaild.runtime.network), without a jail.

An audit hook cannot be removed once added, so every case runs in a fresh interpreter of its
own. The positive control is the same probe in the same interpreter before the hook is
installed: the calls reach the C library and the kernel (localhost's port 9: refused, or
whatever answers there), so the ``PermissionError`` after it is the hook's doing. Inside a jail the seccomp filter refuses
the same sockets again (tests/integration/test_network_refusal.py, tests/hostile).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import asyncio, errno, json, socket, _socket, sys, urllib.request
from jaild.protocol.messages import NetworkRefusal
from jaild.runtime import network

def attempt(f):
    try:
        f()
    except PermissionError as e:
        return ["refused", e.errno, str(e)]
    except OSError as e:  # the kernel's or the resolver's answer: it got that far
        return ["reached", type(e).__name__, str(e)]
    return ["reached", None, ""]

def connect_async(host):
    async def go():
        _, w = await asyncio.wait_for(asyncio.open_connection(host, 9), 2)
        w.close()
    return lambda: asyncio.run(go())

def urlopen_caught():
    try:
        urllib.request.urlopen("http://localhost:9/", timeout=2)
    except urllib.error.URLError as e:
        if isinstance(e.reason, PermissionError):
            raise e.reason
        raise OSError(str(e))

PROBES = {
    "socket.socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(),
    "_socket.socket": lambda: _socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close(),
    "create_connection": lambda: socket.create_connection(("127.0.0.1", 9), timeout=2),
    "getaddrinfo": lambda: socket.getaddrinfo("localhost", 80),
    "gethostbyname_ex": lambda: socket.gethostbyname_ex("localhost"),
    "urlopen": urlopen_caught,
    "asyncio.open_connection": connect_async("127.0.0.1"),
    "asyncio.open_connection by name": connect_async("localhost"),
}
REFUSAL = NetworkRefusal(families=(2, 10), explanation="policy 'p' has no network; ask.")
"""


def run(code: str) -> object:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_every_way_to_the_network_is_refused_in_words_and_counted() -> None:
    result = run(
        "before = {n: attempt(p)[0] for n, p in PROBES.items()}\n"
        "network.install(REFUSAL)\n"
        "after = {n: attempt(p) for n, p in PROBES.items()}\n"
        "print(json.dumps([before, after, network.take_refused(), network.take_refused()]))\n"
    )
    before, after, count, again = result  # type: ignore[misc]
    assert set(before.values()) == {"reached"}, before  # the control: no hook, no refusal
    for name, (what, code, message) in after.items():
        assert (what, code) == ("refused", 13), (name, what, code, message)  # EACCES
        assert message.startswith("[Errno 13] network access refused in this jail ("), name
        assert message.endswith("): policy 'p' has no network; ask."), name
    assert "(socket(AF_INET, SOCK_STREAM))" in after["socket.socket"][2]
    assert "(socket(AF_INET6, SOCK_DGRAM))" in after["_socket.socket"][2]
    assert "(getaddrinfo('localhost', 80))" in after["getaddrinfo"][2]
    assert "(gethostbyname('localhost'))" in after["gethostbyname_ex"][2]
    assert count == len(after) and again == 0  # each attempt once; take_refused resets


def test_what_the_policy_leaves_open_still_works_and_is_not_counted() -> None:
    result = run(
        "network.install(REFUSAL)\n"
        "a, b = socket.socketpair()\n"  # AF_UNIX: the event loop's self-pipe, the tool channel
        "a.sendall(b'x'); assert b.recv(1) == b'x'\n"
        "c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.close()\n"
        "d = socket.socket(fileno=a.detach())\n"  # a descriptor made elsewhere: family -1
        "asyncio.run(asyncio.sleep(0))\n"
        "host = socket.gethostname()\n"
        "print(json.dumps([d.family == socket.AF_UNIX, network.take_refused()]))\n"
    )
    assert result == [True, 0]


def test_threads_share_the_count_and_a_second_install_changes_nothing() -> None:
    result = run(
        "import threading\n"
        "network.install(REFUSAL)\n"
        "network.install(NetworkRefusal(families=(1,), explanation='other'))\n"
        "def worker():\n"
        "    for _ in range(200):\n"
        "        attempt(PROBES['socket.socket'])\n"
        "threads = [threading.Thread(target=worker) for _ in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "unix = attempt(lambda: socket.socket(socket.AF_UNIX).close())\n"
        "print(json.dumps([network.take_refused(), unix[0]]))\n"
    )
    assert result == [800, "reached"]


@pytest.mark.parametrize("refused", [0, 7])
def test_nothing_installed_counts_nothing(refused: int) -> None:
    """Where the policy has a network the runtime installs nothing: every count is 0."""
    result = run(
        f"for _ in range({refused}):\n    attempt(PROBES['socket.socket'])\n"
        "print(json.dumps(network.take_refused()))\n"
    )
    assert result == 0
