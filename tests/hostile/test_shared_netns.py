"""``network.namespace = "tenant"`` (issue 45, item 4): one tenant's concurrent zygote jails
of a policy share a network namespace -- and nobody else's jails do.

The probe is an abstract Unix socket (and, under ``mode = "loopback"``, a TCP listener on
127.0.0.1), the two things a shared network namespace shares. Job A binds and listens, then
waits in a tool call; job B runs while A waits and connects, sending one byte; then A is
released and takes, without blocking, what reached it. The rendezvous is the tool call: no
sleep, no timeout decides anything. Each job also reports its network namespace (the
``/proc/self/ns/net`` link) and whether it was forked from a zygote (the path under test: a
spawned jail has a namespace of its own whatever the policy says, so B must be forked for a
"B could not reach A" to mean anything).

Positive control: two jobs of one tenant under an opting-in policy, each ``mode``, each
``daemon.zygote_scope``: B reaches A, A gets B's byte, one namespace. Then the same probe
between two tenants (root and uid 65534) under that policy -- with ``zygote_scope =
"policy"`` too, where one zygote forks both tenants' jails and only its per-tenant table
keeps them apart --, between two jobs of a policy that does not opt in, and between an
opting-in policy's job and another policy's (opting in or not): B reaches nothing, A gets
nothing, two namespaces.
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
from collections.abc import Callable

import pytest

from jaild.client import Client, JobResult
from tests.conftest import HOST_UID, DaemonHandle, ForeignClient, guard

pytestmark = pytest.mark.integration

OTHER_UID, GID = 65534, 65534  # another tenant, in group nogroup (the socket's)
POLICIES = {
    # opting in, lo up
    "shared": '[network]\nmode = "loopback"\nnamespace = "tenant"\n',
    # opting in, no network but the abstract socket namespace
    "shared-none": '[network]\nmode = "none"\nnamespace = "tenant"\n',
    # not opting in
    "own": '[network]\nmode = "loopback"\n',
}
POOLS = {
    # a pool per tenant, forked from its zygote: jails come from it and fresh, both paths
    "uid": '[pool]\nmode = "zygote"\nmin = 1\nmax = 2\n',
    # one pool for every tenant: its jails are no one's, so they share nothing (the docs
    # say so); none here, so that every jail of the positive control shares
    "policy": '[pool]\nmode = "zygote"\nmin = 0\nmax = 0\n',
}
IDENTITY = f"[os.readlink('/proc/self/ns/net'), os.getuid() == {HOST_UID}]"
LISTEN = f'''
import os, socket
unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
unix.bind(NAME)
unix.listen(4)
tcp = None
if socket.AF_INET in POLICY_FAMILIES:
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # an earlier A's TIME_WAIT
    tcp.bind(("127.0.0.1", PORT))
    tcp.listen(4)
await tools.hold()
got = []
for s in (unix, tcp):
    if s is None:
        continue
    s.setblocking(False)
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        continue
    conn.setblocking(True)
    got.append(conn.recv(16).decode())
[got, *{IDENTITY}]
'''
CONNECT = f'''
import errno, os, socket
reached = {{}}
families = [("unix", socket.AF_UNIX, NAME)]
if socket.AF_INET in POLICY_FAMILIES:
    families.append(("tcp", socket.AF_INET, ("127.0.0.1", PORT)))
for kind, family, where in families:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.connect(where)
        s.sendall(kind.encode())
        reached[kind] = True
    except OSError as exc:
        reached[kind] = errno.errorcode.get(exc.errno, str(exc.errno))
    finally:
        s.close()
[reached, *{IDENTITY}]
'''


def code(probe: str, policy: str, name: str, port: int) -> str:
    """``probe`` for ``policy`` (the loopback policies also probe TCP on 127.0.0.1), at the
    abstract socket ``name`` and the port ``port``: each rendezvous its own, since a jail of
    an earlier one may still be alive for a moment after its job's result (and, sharing the
    namespace, listening there)."""
    families = "(socket.AF_UNIX, socket.AF_INET)" if POLICIES[policy].count('"loopback"') else (
        "(socket.AF_UNIX,)")
    return (f"import socket\nPOLICY_FAMILIES = {families}\nNAME = {name!r}\n"
            f"PORT = {port}\n" + probe)


RENDEZVOUS = itertools.count(47011)


# As another uid: jobs until one is forked from its zygote (its first is spawned while its
# zygote starts, in uid scope), then the probe; prints the probe's job's [status, result].
FOREIGN_WARM = f'''
import json, sys, time
from jaild.client import Client
c = Client(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[3])
while True:
    r = c.run("import os\\n" + {IDENTITY!r}, policy=sys.argv[2])
    assert r.status == "ok", r.error
    if r.result[1]:
        break
    assert time.monotonic() < deadline, "no job of this uid was ever forked"
    time.sleep(0.1)
print("forked")
'''
FOREIGN_RUN = '''
import json, sys
from jaild.client import Client
r = Client(sys.argv[1]).run(sys.argv[3], policy=sys.argv[2])
print(json.dumps([r.status, r.result, r.error]))
'''

B = Callable[[str, str], list[object]]
"""(policy, code) -> job B's result, run while A waits."""


def rendezvous(d: DaemonHandle, a_policy: str, run_b: B, b_policy: str) -> tuple[
        list[object], list[object]]:
    """A (root) listens and waits in a tool call; B runs to its end; A is released."""
    up, release = threading.Event(), threading.Event()

    def hold() -> bool:
        up.set()
        return release.wait(guard(60))

    port = next(RENDEZVOUS)
    name = f"\0jaild-shared-netns-{port}-{secrets.token_hex(4)}"
    with Client(d.socket) as a_client:
        job = a_client.submit(code(LISTEN, a_policy, name, port), policy=a_policy,
                              tools={"hold": hold})
        try:
            assert up.wait(guard(60)), "job A did not reach its tool call"
            b = run_b(b_policy, code(CONNECT, b_policy, name, port))
        finally:
            release.set()
        a: JobResult = job.result(guard(60))
    assert a.status == "ok", (a.status, a.error, a.stderr)
    return a.result, b


def root_b(d: DaemonHandle) -> B:
    def run(policy: str, probe: str) -> list[object]:
        with Client(d.socket) as c:
            r = c.run(probe, policy=policy)
        assert r.status == "ok", (r.status, r.error, r.stderr)
        return r.result  # type: ignore[no-any-return]
    return run


def foreign_b(d: DaemonHandle, client: ForeignClient) -> B:
    def run(policy: str, probe: str) -> list[object]:
        out = client.run(FOREIGN_RUN, d.socket, policy, probe, uid=OTHER_UID, gid=GID,
                         timeout=120)
        assert out.returncode == 0, out.stderr
        status, result, error = json.loads(out.stdout)
        assert status == "ok", error
        return result  # type: ignore[no-any-return]
    return run


def warm_foreign(d: DaemonHandle, client: ForeignClient, policy: str) -> None:
    out = client.run(FOREIGN_WARM, d.socket, policy, str(guard(60)), uid=OTHER_UID, gid=GID,
                     timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "forked", out.stderr


def assert_shared(a: list[object], b: list[object], kinds: set[str]) -> None:
    (got, a_net, a_forked), (reached, b_net, b_forked) = a, b
    assert a_forked and b_forked, "a job was spawned, not forked: not the path under test"
    assert reached == dict.fromkeys(kinds, True), reached
    assert sorted(got) == sorted(kinds)  # type: ignore[arg-type]
    assert a_net == b_net


def assert_apart(a: list[object], b: list[object], case: str = "") -> None:
    (got, a_net, a_forked), (reached, b_net, b_forked) = a, b
    assert a_forked and b_forked, f"{case}: a job was spawned, not forked: not the path under test"
    assert isinstance(reached, dict) and reached, (case, reached)
    assert all(v == "ECONNREFUSED" for v in reached.values()), (case, reached)
    assert got == [], f"{case}: A was reached by a job it shares nothing with"
    assert a_net != b_net, case


@pytest.fixture
def daemon_of(reachable_daemon: Callable[[dict[str, str], str], DaemonHandle]
              ) -> Callable[[str], DaemonHandle]:
    """A daemon uid 65534 may reach, serving :data:`POLICIES` with the scope's pools, in
    ``zygote_scope``."""
    return lambda scope: reachable_daemon(
        {name: text + POOLS[scope] for name, text in POLICIES.items()},
        f'zygote_scope = "{scope}"\n')


@pytest.mark.parametrize("scope", ["uid", "policy"])
def test_one_tenants_jails_share_and_another_tenants_stay_apart(
        daemon_of: Callable[[str], DaemonHandle], foreign_client: ForeignClient,
        scope: str) -> None:
    d = daemon_of(scope)
    # Positive control: two jobs of one tenant (root), each opting-in policy.
    a, b = rendezvous(d, "shared", root_b(d), "shared")
    assert_shared(a, b, {"unix", "tcp"})
    a, b = rendezvous(d, "shared-none", root_b(d), "shared-none")
    assert_shared(a, b, {"unix"})
    # The same probe, B another tenant's job, forked (in "policy" scope: by the same zygote).
    warm_foreign(d, foreign_client, "shared")
    a, b = rendezvous(d, "shared", foreign_b(d, foreign_client), "shared")
    assert_apart(a, b)


def test_jails_of_other_policies_and_of_policies_not_opting_in_stay_apart(
        daemon_of: Callable[[str], DaemonHandle]) -> None:
    d = daemon_of("uid")
    # (the positive control, one tenant under one opting-in policy, is the test above)
    for a_policy, b_policy in [
        ("own", "own"),  # a policy that does not opt in
        ("shared", "own"),  # one that does, and one that does not
        ("own", "shared"),
        ("shared", "shared-none"),  # two that do: each policy's jails share among themselves
    ]:
        a, b = rendezvous(d, a_policy, root_b(d), b_policy)
        assert_apart(a, b, f"A of {a_policy}, B of {b_policy}")
