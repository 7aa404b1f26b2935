"""What a forked jail does before its job, written so that it writes -- and so copies from
its zygote -- as few pages as it can (docs/performance.md, "The cost of a fresh jail";
``bench/pages.py`` measures it): the preamble a plain write on fd 0 that still carries the
jail's credentials, the zygote's signal handling undone with ``_signal``'s C functions, the
runtime's modules imported by the zygote and not by each jail, the random generators reseeded
without the Python half of ``random.Random.seed``.
"""

from __future__ import annotations

import ast
import gc
import inspect
import os
import random
import signal
import socket
import struct
import textwrap
from collections.abc import Callable

from jaild.errors import SetupFailed
from jaild.protocol.zygote_link import MAX_SPAWN_ID, JailReaped, decode_packet
from jaild.protocol.zygote_link import encode as encode_packet
from jaild.runtime import main as runtime_main
from jaild.runtime import reseed, zygote

SCM_CREDENTIALS = 2


def _in_child(body: Callable[[], int]) -> int:
    """``body``'s return value as the exit status of a forked child (3: it raised
    SetupFailed, 4: anything else)."""
    pid = os.fork()
    if pid == 0:
        try:
            code = body()
        except SetupFailed:
            code = 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _preamble_run(answer: bytes | None) -> tuple[bytes, int | None, int, int]:
    """A child awaits its cgroup on fd 0; the test, as the daemon, reads the preamble and
    its credentials and answers ``answer`` (None: closes). Returns (preamble, the pid its
    credentials name, the child's pid, its exit status)."""
    daemon_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def jail() -> int:
        daemon_end.close()
        os.dup2(jail_end.fileno(), 0)
        zygote._await_cgroup(placed=False)
        return 0

    pid = os.fork()
    if pid == 0:
        try:
            code = jail()
        except SetupFailed:
            code = 3
        except BaseException:
            code = 4
        os._exit(code)
    jail_end.close()
    with daemon_end:
        data, ancdata, _, _ = daemon_end.recvmsg(1, socket.CMSG_SPACE(12))
        creds = [d for lvl, kind, d in ancdata
                 if (lvl, kind) == (socket.SOL_SOCKET, SCM_CREDENTIALS)]
        if answer is not None:
            daemon_end.sendall(answer)
    _, status = os.waitpid(pid, 0)
    sender = struct.unpack("3i", creds[0][:12])[0] if creds else None
    return data, sender, pid, os.waitstatus_to_exitcode(status)


def test_the_preamble_is_a_plain_write_that_still_carries_the_jails_credentials() -> None:
    data, sender, pid, status = _preamble_run(zygote.GO)
    assert data == zygote.PREAMBLE
    assert sender == pid  # what the daemon moves into the job's cgroup
    assert status == 0


def test_a_jail_goes_on_only_on_the_daemons_go() -> None:
    assert _preamble_run(b"X")[3] == 3  # anything else: SetupFailed, no job
    assert _preamble_run(None)[3] == 3  # the daemon closed the channel
    assert _preamble_run(zygote.GO)[3] == 0  # positive control


def test_a_jail_lets_go_of_the_zygotes_signals_socket_and_young_objects() -> None:
    made_before: list[list[int]] = [[]]  # a young object of the "zygote's", tracked by the collector
    control, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def body() -> int:
        _r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        young = any(o is made_before for o in gc.get_objects())
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL or not young:
            return 1  # positive control: the handlers are in place, the collector sees it
        zygote._leave_zygote(control)
        default = all(signal.getsignal(s) == signal.SIG_DFL
                      for s in (signal.SIGCHLD, signal.SIGTERM))
        if not default or signal.set_wakeup_fd(-1) != -1:
            return 2
        if control.fileno() != -1:
            return 5
        if any(o is made_before for o in gc.get_objects()):
            return 6  # the jail's collector would walk (and write) the zygote's objects
        return 0

    try:
        assert _in_child(body) == 0
    finally:
        control.close()
        peer.close()


def _imports_in(function: Callable[..., object]) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_a_jails_runtime_imports_nothing_the_zygote_could_have() -> None:
    # An import statement run in a jail writes the import machinery's objects (each a
    # copied page); the zygote imports the runtime's modules (zygote._RUNTIME_MODULES), and
    # the runtime names them at its module level.
    assert _imports_in(runtime_main.main) == []
    for name in ("channel", "harden", "network", "execute", "files", "tools"):
        assert f"jaild.runtime.{name}" in zygote._RUNTIME_MODULES


def test_reseeding_a_random_gives_it_fresh_state_and_forgets_its_gauss() -> None:
    gen = random.Random(42)
    twin = random.Random(42)
    gen.gauss(0, 1)  # keeps a second normal variate for the next call
    assert gen.gauss_next is not None  # type: ignore[attr-defined]
    assert reseed.reseed([gen]) == 1
    assert gen.gauss_next is None  # type: ignore[attr-defined]
    twin.random()
    assert gen.getstate() != twin.getstate()
    other = random.Random(42)
    reseed.reseed([other])
    assert other.getstate() != gen.getstate()  # each from its own entropy


def test_a_random_subclass_is_reseeded_through_its_own_seed() -> None:
    seen: list[object] = []

    class Mine(random.Random):
        def seed(self, *args: object, **kwargs: object) -> None:
            seen.append(args[0] if args else None)
            super().seed(*args, **kwargs)  # type: ignore[arg-type]

    gen = Mine(1)
    seen.clear()
    reseed.reseed([gen])
    assert len(seen) == 1 and isinstance(seen[0], bytes)


def test_the_zygotes_reaped_packet_is_the_message_byte_for_byte() -> None:
    for spawn_id, status, cpu_s, maxrss_kb in ((0, 0, 0.0, 0), (7, 9 << 8, 0.0125, 12_345),
                                               (MAX_SPAWN_ID, (1 << 31) - 1, 1e6, 1 << 40)):
        message = JailReaped(spawn_id=spawn_id, status=status, cpu_s=cpu_s,
                             maxrss_kb=maxrss_kb)
        packet = zygote._reaped(spawn_id, status, cpu_s, maxrss_kb)
        assert packet == encode_packet(message)
        assert decode_packet(packet, "zygote->daemon") == message
