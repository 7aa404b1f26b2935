"""A forked jail under its zygote's filters and its own gives every call the policy's verdict.

``daemon.zygote_seccomp = "split"`` (the default) has each zygote load its policy's filters
with what it needs let through, and each jail take that back with a small filter of its own
(jaild/runtime/zygote_filter.py; the BPF-level proof is tests/unit/test_zygote_filter.py).
Here the kernel answers: every call the zygote needs and the policy refuses is tried from a
forked jail of each daemon, split and whole, and must end the same way, the way the policy
says -- killed naming the call, or refused with its errno. Positive control: the same calls
succeed in a process of the zygote's kind that holds the zygote's filters only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from tests.conftest import REPO, DaemonHandle, start_daemon, sweep_cgroups

POLICY = (REPO / "policies" / "default.toml").read_text()

# Each probe: (name, code). Every one asks the kernel for something the default policy
# refuses and the zygote's own filters allow.
PROBES: dict[str, str] = {
    "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    "umount2": "libc.umount2(b'/tmp', 2)",
    "unshare": "libc.unshare(0x40000000)",
    "setns": "libc.setns(0, 0x40000000)",
    "sethostname": "libc.sethostname(b'x', 1)",
    "setresuid": "libc.syscall(117, 0, 0, 0)",
    "setgroups": "libc.syscall(116, 0, None)",
    "capset": "libc.syscall(126, 0, 0)",
    "clone": "libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0)",
    "ioctl": "libc.ioctl(0, 0x5412, b'x')",
}
CODE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
rc = {call}
result = [rc, ctypes.get_errno(), open('/proc/self/status').read().split('Seccomp_filters:')[1].split()[0]]
result
"""


def _outcome(client: Client, name: str) -> tuple[str, object]:
    r = client.run(CODE.format(call=PROBES[name]))
    if r.status == "ok":
        rc, err, filters = r.result
        return f"returned {rc} errno {err}", filters
    assert r.error is not None
    # (the call's name comes from the kernel's audit log, which the kernel rate-limits)
    return f"{r.status}: {r.error.get('signal')}", None


@pytest.fixture(scope="module")
def two_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Client]]:
    handles: list[DaemonHandle] = []
    clients = []
    for mode in ("split", "whole"):
        where = tmp_path_factory.mktemp(f"zs-{mode}")
        config = where / "jaild.toml"
        config.write_text(f'[daemon]\nzygote_seccomp = "{mode}"\n')
        handle = start_daemon(where / "d", {"default": POLICY}, with_repo_policies=False,
                              args=("--config", str(config)))
        handles.append(handle)
        clients.append(Client(handle.socket))
    try:
        yield clients[0], clients[1]
    finally:
        for handle in handles:
            handle.stop()
            sweep_cgroups(handle)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_call_the_zygote_needs_gets_the_policys_verdict_in_a_split_jail(
    two_daemons: tuple[Client, Client], name: str
) -> None:
    split, whole = two_daemons
    got, _ = _outcome(split, name)
    expected, _ = _outcome(whole, name)
    assert got == expected
    # and that verdict is the default policy's: it kills the job
    assert got == "policy_violation: SIGSYS", got


def test_a_split_jail_holds_its_zygotes_filters_and_one_of_its_own(
    two_daemons: tuple[Client, Client],
) -> None:
    split, whole = two_daemons
    status = "open('/proc/self/status').read().split('Seccomp_filters:')[1].split()[0]"
    assert split.run(status).result == "3"  # the zygote's two, its own one
    assert whole.run(status).result == "2"  # the policy's two


PROBE_UNDER_ZYGOTE_FILTERS = r"""
import ctypes, json, os, sys
sys.path[:0] = [sys.argv[1]]
from jaild.policy.schema import load_policy
from jaild.policy.seccomp import build_spec
from jaild.runtime import seccomp
policy = load_policy(sys.argv[2])
seccomp.prepare(build_spec(policy.seccomp_choice, network=False), split=True)
libc = ctypes.CDLL(None, use_errno=True)
out = {}
assert libc.unshare(0x10000000) == 0  # a user namespace of its own: nothing reaches the host
out["unshare"] = libc.unshare(0x40000000 | 0x04000000 | 0x00020000)  # net, uts, mount
out["mount"] = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
out["sethostname"] = libc.sethostname(b"x", 1)
print(json.dumps(out))
"""


def test_positive_control_the_zygotes_filters_alone_let_those_calls_through(
    tmp_path: Path,
) -> None:
    """A process holding only the zygote's part (as the zygote does) makes the calls the
    jails' part takes back: in a user namespace of its own, they succeed."""
    policy = tmp_path / "default.toml"
    policy.write_text(POLICY)
    done = subprocess.run(
        [sys.executable, "-c", PROBE_UNDER_ZYGOTE_FILTERS, str(REPO), str(policy)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"unshare": 0, "mount": 0, "sethostname": 0}
