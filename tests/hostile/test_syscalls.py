"""Every syscall no policy may allow, tried from inside a jail.

Each probe calls the syscall directly (ctypes ``syscall(2)``) with harmless arguments
and prints the return value and errno. Positive control: the same probe, run on the host
outside any jail, reaches the kernel and comes back (an errno from the kernel, or
success) -- so the kill inside the jail is the filter's doing. Under a ``kill`` policy
the job ends ``policy_violation``; under an ``errno`` policy the call fails with EPERM.

A network attempt without a network is the exception (issue 17, item 5): ``socket`` and
``socketpair`` of AF_INET/AF_INET6 fail with EACCES before the kernel sees them, under every
action and profile, and the job goes on; the families that are kernel attack surface still
kill, with or without a network. The control for those is a policy with a network
(``netprobe``), where the same probe reaches the kernel.
"""

from __future__ import annotations

import errno

import pytest

from jaild.runtime.seccomp import syscall_number
from tests.conftest import DaemonHandle, run_unjailed

pytestmark = pytest.mark.integration

CLONE_NEWUSER, CLONE_FS = 0x10000000, 0x00000200
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# socket families that are kernel attack surface, not a network: never allowed
DANGEROUS_FAMILIES = [
    ("socket", [16, 3, 0]),  # AF_NETLINK (NETLINK_ROUTE)
    ("socket", [17, 3, 0]),  # AF_PACKET
    ("socket", [38, 5, 0]),  # AF_ALG
    ("socket", [40, 1, 0]),  # AF_VSOCK
    # socketpair makes both sockets in the kernel before the family says it cannot pair them
    # (EOPNOTSUPP on the host): it is filtered like socket()
    ("socketpair", [16, 3, 0, 0]),  # AF_NETLINK
    ("socketpair", [17, 3, 0, 0]),  # AF_PACKET
    ("socketpair", [38, 5, 0, 0]),  # AF_ALG
    ("socketpair", [40, 1, 0, 0]),  # AF_VSOCK
]

# name, arguments (all harmless: NULL pointers, bad descriptors, invalid flags)
DENIED = [
    ("ptrace", [16, 1 << 22, 0, 0]),  # PTRACE_ATTACH to a pid that does not exist
    ("process_vm_readv", [1 << 22, 0, 0, 0, 0, 0]),
    ("process_vm_writev", [1 << 22, 0, 0, 0, 0, 0]),
    ("mount", [0, 0, 0, 0, 0]),
    ("umount2", [0, 0]),
    ("pivot_root", [0, 0]),
    ("chroot", [0]),
    ("unshare", [0]),
    ("setns", [-1, 0]),
    ("clone", [CLONE_NEWUSER | CLONE_FS, 0, 0, 0, 0]),  # EINVAL on the host: no process made
    ("keyctl", [0, -1, 0]),
    ("add_key", [0, 0, 0, 0, -2]),
    ("request_key", [0, 0, 0, 0]),
    ("bpf", [-1, 0, 0]),
    ("perf_event_open", [0, 0, -1, -1, 0]),
    ("userfaultfd", [-1]),
    ("kexec_load", [0, 0, 0, 0xFFFFFFFF]),
    ("kexec_file_load", [-1, -1, 0, 0, 0xFFFFFFFF]),
    ("init_module", [0, 0, 0]),
    ("finit_module", [-1, 0, 0]),
    ("delete_module", [0, 0]),
    ("reboot", [0, 0, 0, 0]),  # wrong magic numbers: EINVAL before anything happens
    ("swapon", [0, 0]),
    ("swapoff", [0]),
    ("quotactl", [0, 0, 0, 0]),
    ("open_by_handle_at", [-1, 0, 0]),
    ("name_to_handle_at", [-1, 0, 0, 0, 0]),
    ("fsopen", [0, 0]),
    ("open_tree", [-1, 0, 0]),
    ("move_mount", [-1, 0, -1, 0, 0]),
    ("mknod", [0, 0, 0]),
    ("personality", [0x0400000]),  # READ_IMPLIES_EXEC
    *DANGEROUS_FAMILIES,
    ("ioctl", [0, TIOCSTI, 0]),
    ("ioctl", [0, TIOCLINUX, 0]),
    ("ioctl", [0, (1 << 32) | TIOCSTI, 0]),  # upper bits set: the kernel still sees TIOCSTI
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(DENIED)]


def probe(name: str, args: list[int]) -> str:
    nr = syscall_number(name)
    assert nr is not None, name
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"rc = libc.syscall({nr}, *[ctypes.c_long(a) for a in {args!r}])\n"
        "err = ctypes.get_errno()\n"
        "print(rc, err)\n"
        "[rc, err]"
    )


@pytest.mark.parametrize(("name", "args"), DENIED, ids=IDS)
def test_denied_syscall_kills_the_job(hostile: DaemonHandle, name: str, args: list[int]) -> None:
    control = run_unjailed(probe(name, args))
    # outside a jail the probe survives and the kernel answers (some kernels, like this
    # VM's without kexec, answer ENOSYS: the filter in the jail acts before the kernel does)
    assert control.returncode == 0, control.stderr
    assert len(control.stdout.split()) == 2
    r = hostile.run(probe(name, args))
    assert r.status == "policy_violation", (r.status, r.error, r.stdout)
    assert r.error is not None and r.error["signal"] == "SIGSYS"
    assert r.error["syscall"] in (name, None)  # named when the kernel's audit record got through
    if r.error["syscall"] in ("socket", "socketpair"):
        assert "a socket of an address family the policy does not allow" in r.error["message"]
    hostile.assert_serving()


@pytest.mark.parametrize(("name", "args"), DANGEROUS_FAMILIES,
                         ids=[f"{n}-{a[0]}" for n, a in DANGEROUS_FAMILIES])
def test_dangerous_socket_families_kill_even_where_the_policy_has_a_network(
        hostile: DaemonHandle, name: str, args: list[int]) -> None:
    """Netlink, packet, alg and vsock sockets are kernel attack surface, not a network: a
    policy with a network (netprobe, loopback) kills them as the default policy does."""
    control = run_unjailed(probe(name, args))
    assert control.returncode == 0, control.stderr
    assert len(control.stdout.split()) == 2
    r = hostile.run(probe(name, args), policy="netprobe")
    assert r.status == "policy_violation", (r.status, r.error, r.stdout)
    assert r.error is not None and r.error["syscall"] in (name, None)


INET = [
    ("socket", [2, 1, 0]),  # AF_INET, SOCK_STREAM
    ("socket", [10, 2, 0]),  # AF_INET6, SOCK_DGRAM
    ("socketpair", [2, 1, 0, 0]),
    ("socketpair", [10, 1, 0, 0]),
]


@pytest.mark.parametrize(("name", "args"), INET, ids=[f"{n}-{a[0]}" for n, a in INET])
def test_inet_without_a_network_is_refused_by_the_filter_not_killed(
        hostile: DaemonHandle, name: str, args: list[int]) -> None:
    """The raw syscall, out of the runtime's sight (no audit hook sees ctypes): the filter
    alone answers EACCES, before the kernel -- under the kill action, the errno action
    (whose own answer is EPERM) and the strict profile (which has no socket() at all). The
    runtime counts nothing it did not see. Controls: on the host, and under a policy with a
    network, the same probe reaches the kernel (a descriptor; for socketpair, whose vector
    is NULL here, the kernel's EFAULT)."""
    on_host = run_unjailed(probe(name, args))
    assert on_host.returncode == 0, on_host.stderr
    kernel = [int(v) for v in on_host.stdout.split()]
    assert kernel[0] >= 0 if name == "socket" else kernel == [-1, errno.EFAULT], kernel
    r = hostile.run(probe(name, args), policy="netprobe")
    assert r.status == "ok", (r.status, r.error)
    assert (r.result[0] >= 0) if name == "socket" else r.result == kernel, r.result
    for policy in ("default", "strict", "errno", "data"):
        r = hostile.run(probe(name, args), policy=policy)
        assert (r.status, r.result) == ("ok", [-1, errno.EACCES]), (policy, r.status, r.error)
        assert r.network_refused == 0, policy


@pytest.mark.parametrize(("name", "args"), DENIED, ids=IDS)
def test_denied_syscall_fails_with_eperm_under_errno_action(hostile: DaemonHandle, name: str,
                                                          args: list[int]) -> None:
    r = hostile.run(probe(name, args), policy="errno")
    assert r.status == "ok", (r.status, r.error)
    assert r.result == [-1, errno.EPERM]


@pytest.mark.parametrize("name", ["clone3", "io_uring_setup", "io_uring_enter", "mbind"])
def test_probed_syscalls_fail_softly_under_kill_action(hostile: DaemonHandle, name: str) -> None:
    """Libraries probe these and fall back: they fail (ENOSYS/EPERM) instead of killing."""
    args = {"clone3": [0, 0], "io_uring_setup": [0, 0], "io_uring_enter": [-1, 0, 0, 0, 0, 0],
            "mbind": [0, 0, 0, 0, 0, 0]}[name]
    control = run_unjailed(probe(name, args))
    assert control.returncode == 0
    assert int(control.stdout.split()[1]) != errno.ENOSYS or name == "clone3"
    r = hostile.run(probe(name, args))
    expected = errno.EPERM if name == "mbind" else errno.ENOSYS
    assert (r.status, r.result) == ("ok", [-1, expected])


def socketpair_probe(family: int, kind: int) -> str:
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "sv = (ctypes.c_int * 2)()\n"
        f"rc = libc.socketpair({family}, {kind}, 0, sv)\n"
        "err = ctypes.get_errno() if rc else 0\n"
        "if rc == 0:\n"
        "    import os\n"
        "    os.write(sv[0], b'ping')\n"
        "    assert os.read(sv[1], 4) == b'ping'\n"
        "print([rc, err])\n"
        "[rc, err]"
    )


@pytest.mark.parametrize("policy", ["default", "strict", "data", "errno"])
def test_unix_socketpairs_still_work(hostile: DaemonHandle, policy: str) -> None:
    for kind in (1, 2, 5):  # SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
        r = hostile.run(socketpair_probe(1, kind), policy=policy)
        assert (r.status, r.result) == ("ok", [0, 0]), (policy, kind, r.status, r.error)


@pytest.mark.parametrize("family", [2, 10])  # AF_INET, AF_INET6
def test_socketpair_families_follow_the_network_mode(hostile: DaemonHandle, family: int) -> None:
    """Where a policy has a network (netprobe: loopback), inet socketpairs reach the kernel,
    which answers as it does on the host: the filter follows socket()'s family rule."""
    control = run_unjailed(socketpair_probe(family, 1))
    assert control.returncode == 0, control.stderr
    assert control.stdout.split() == ["[-1,", f"{errno.EOPNOTSUPP}]"]
    r = hostile.run(socketpair_probe(family, 1), policy="netprobe")
    assert (r.status, r.result) == ("ok", [-1, errno.EOPNOTSUPP]), (r.status, r.error)
    r = hostile.run(socketpair_probe(family, 1), policy="errno")  # no network: refused
    assert (r.status, r.result) == ("ok", [-1, errno.EACCES]), (r.status, r.error)
