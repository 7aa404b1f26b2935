"""``network.namespace = "tenant"``: one tenant's concurrent zygote jails of a policy share a
network namespace (issue 45, item 4). The pure parts, root-free: the policy's checks and
their messages, the plan the daemon sends (whose key, for which jails), the steps a jail
follows, the zygote's table of kept namespaces. ``tests/hostile/test_shared_netns.py``
runs the real thing, tenants and policies against each other, with its positive control.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaild.errors import LocalProtocolError, PolicyError
from jaild.policy.compile import (
    CgroupLayout,
    HostLayout,
    JobFacts,
    compile_policy,
    forked_jail,
    render_config,
    shared_net,
)
from jaild.policy.schema import Policy, load_policy_text, reference_markdown
from jaild.protocol.zygote_link import JailSetup, SpawnJail, decode_packet, encode
from jaild.runtime import zygote
from jaild.runtime.zygote import SetupFailed, Step

HOST = HostLayout("/var/lib/jaild/runtime/0123", "/var/lib/jaild/envs", CgroupLayout(2, "jaild"))
JOB_UID = 1073741824 + 42


def policy(network: str, pool: str = "", path: str = "/p/shared.toml") -> Policy:
    return load_policy_text(f"[network]\n{network}\n{pool}", path)


def error_of(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "/p/shared.toml")
    return info.value.message


def jail(p: Policy, tenant: str = "1000", *, uid: int = JOB_UID) -> JailSetup:
    return forked_jail(p, HOST, JobFacts(p.limits, uid, tenant=tenant))


SHARED = policy('mode = "loopback"\nnamespace = "tenant"')
OWN = policy('mode = "loopback"')


# ------------------------------------------------------------------------ the policy


def test_the_setting_is_off_by_default_and_loads_where_it_makes_sense() -> None:
    assert load_policy_text("", "/p/d.toml").network.namespace == "jail"
    for mode in ("none", "loopback"):
        assert policy(f'mode = "{mode}"\nnamespace = "tenant"').network.namespace == "tenant"


@pytest.mark.parametrize(("text", "reason"), [
    ('[network]\nmode = "host"\nnamespace = "tenant"\n',
     'network.namespace: "tenant" needs network.mode = "none" or "loopback": with "host" a '
     "jail has no network namespace of its own to share"),
    ('[network]\nmode = "egress"\nnamespace = "tenant"\n[egress]\nallow = ["pypi.org"]\n',
     'network.namespace: "tenant" needs network.mode = "none" or "loopback": an egress '
     "jail's gateway door listens on its own 127.0.0.1:3128"),
    ('[network]\nnamespace = "tenant"\n[pool]\nmode = "spawn"\n',
     'network.namespace: "tenant" needs pool.mode = "zygote": a spawned jail (an nsjail per '
     "job) always gets a network namespace of its own"),
    ('[network]\nnamespace = "pod"\n',
     "network.namespace: must be one of jail, tenant; got 'pod'"),
    ("[network]\nnamespace = true\n", "network.namespace: must be a string, got True"),
])
def test_mistakes_name_file_key_and_reason(text: str, reason: str) -> None:
    message = error_of(text)
    assert message.startswith("/p/shared.toml: ")
    assert reason in message, message
    # positive control: the same file with the setting at its default loads
    load_policy_text(text.replace('namespace = "tenant"', 'namespace = "jail"')
                     .replace('namespace = "pod"', "").replace("namespace = true", ""),
                     "/p/shared.toml")


def test_the_reference_documents_the_setting() -> None:
    row = next(line for line in reference_markdown().splitlines()
               if line.startswith("| `network.namespace`"))
    assert '`"jail"`' in row and "abstract Unix sockets and loopback" in row


# ------------------------------------------------------------------------ the plan


def test_a_forked_jail_of_an_opting_in_policy_shares_its_tenants_namespace() -> None:
    setup = jail(SHARED, "1000")
    assert setup.shared_net == "1000"
    assert "net" not in setup.namespaces and setup.loopback
    assert jail(SHARED, "pod-0b5c").shared_net == "pod-0b5c"


@pytest.mark.parametrize("case", ["policy does not opt in", "tenant unknown", "spawned"])
def test_every_other_jail_gets_a_namespace_of_its_own(case: str) -> None:
    if case == "policy does not opt in":
        setup = jail(OWN, "1000")
    elif case == "tenant unknown":
        setup = jail(SHARED, "")
    else:  # spawn mode's plan of the same policy and job (an nsjail would make it)
        plan = compile_policy(SHARED, HOST, JobFacts(SHARED.limits, JOB_UID, tenant="1000"))
        setup = plan.jail
        assert "clone_newnet: true" in render_config(plan)
    assert setup.shared_net == ""
    assert "net" in setup.namespaces


def test_two_tenants_never_get_one_key() -> None:
    tenants = ["0", "1000", "1001", "pod-0b5c", "sa-0123456789abcdef", "cert-0123456789abcdef"]
    keys = [shared_net(SHARED, JobFacts(SHARED.limits, JOB_UID, tenant=t), forked=True)
            for t in tenants]
    assert len(set(keys)) == len(tenants)


def test_a_tenant_key_the_link_cannot_carry_becomes_a_digest_of_it() -> None:
    odd = ["pod/x y", "p" * 200]
    keys = [jail(SHARED, t).shared_net for t in odd]
    assert all(k.startswith("t-") and len(k) == 34 for k in keys)
    assert len(set(keys)) == 2


def test_the_key_crosses_the_link_and_is_checked() -> None:
    setup = jail(SHARED)
    got = decode_packet(encode(SpawnJail(3, setup)), "daemon->zygote")
    assert isinstance(got, SpawnJail) and got.jail == setup
    for bad in ({"shared_net": "../x"}, {"shared_net": "a" * 129},
                {"namespaces": (*setup.namespaces, "net")}):
        with pytest.raises(LocalProtocolError):
            dataclasses.replace(setup, **bad)  # type: ignore[arg-type]
    # positive controls: a plain key, and the jail with a namespace of its own
    dataclasses.replace(setup, shared_net="pod-0b5c-11.x_y")
    dataclasses.replace(setup, shared_net="", namespaces=(*setup.namespaces, "net"))


# ------------------------------------------------------------------------ the steps


def test_a_sharing_jail_joins_instead_of_unsharing_and_leaves_lo_to_the_zygote() -> None:
    steps = zygote.jail_steps(jail(SHARED, "1000"))
    own = zygote.jail_steps(jail(OWN, "1000"))
    assert steps[0].op == "unshare" and own[0].op == "unshare"
    assert steps[0].args[0] == own[0].args[0] & ~zygote.CLONE_NEWNET
    assert own[0].args[0] & zygote.CLONE_NEWNET
    assert steps[1] == Step("join_net", ("1000", True))
    assert "loopback_up" not in [s.op for s in steps] and "loopback_up" in [s.op for s in own]
    assert "join_net" not in [s.op for s in own]
    # the rest is the same plan
    assert steps[2:] == [s for s in own[1:] if s.op != "loopback_up"]
    assert zygote._shared_net(steps) == ("1000", True)
    assert zygote._shared_net(own) is None
    none_mode = zygote.jail_steps(jail(policy('namespace = "tenant"'), "7"))
    assert zygote._shared_net(none_mode) == ("7", False)


def test_a_plan_that_joins_and_unshares_the_network_is_refused() -> None:
    setup = jail(SHARED)
    bad = JailSetup.__new__(JailSetup)  # past the struct's own check, as a buggy sender's
    for field in dataclasses.fields(JailSetup):
        object.__setattr__(bad, field.name, getattr(setup, field.name))
    object.__setattr__(bad, "namespaces", (*setup.namespaces, "net"))
    with pytest.raises(SetupFailed):
        zygote.jail_steps(bad)
    zygote.jail_steps(setup)  # positive control


def test_the_plans_cache_keeps_tenants_apart() -> None:
    plans = zygote.Plans()
    for _ in range(2):  # read, then from the cache
        a = plans.read(encode(SpawnJail(1, jail(SHARED, "1000", uid=JOB_UID))))
        b = plans.read(encode(SpawnJail(2, jail(SHARED, "1001", uid=JOB_UID + 1))))
        assert isinstance(a, zygote.Spawn) and isinstance(b, zygote.Spawn)
        assert isinstance(a.steps, list) and isinstance(b.steps, list)
        assert zygote._shared_net(a.steps) == ("1000", True)
        assert zygote._shared_net(b.steps) == ("1001", True)
        assert a.steps[-1] == Step("become", (JOB_UID,))
        assert b.steps[-1] == Step("become", (JOB_UID + 1,))


# ------------------------------------------------------------------------ the zygote's table


class FakeNets(zygote.SharedNets):
    """The table without the kernel: each namespace made is a new number."""

    MAX = 3

    def __init__(self) -> None:
        super().__init__(own=-1)
        self.made: list[bool] = []
        self.closed: list[int] = []

    def _make(self, loopback: bool) -> int:
        self.made.append(loopback)
        return 100 + len(self.made)


@pytest.fixture
def nets(monkeypatch: pytest.MonkeyPatch) -> FakeNets:
    table = FakeNets()
    monkeypatch.setattr(zygote.os, "close", table.closed.append)
    return table


def test_one_namespace_per_key_made_once(nets: FakeNets) -> None:
    assert nets.take("1000", True) == (101, True)
    assert nets.take("1000", True) == (101, True)  # not made again
    assert nets.take("1001", True) == (102, True)  # another tenant: another namespace
    assert nets.take("1000", False) == (103, True)  # lo down is another namespace
    assert nets.made == [True, True, False]


def test_past_the_bound_an_idle_namespace_goes_and_a_busy_one_stays(nets: FakeNets) -> None:
    for pid, key in enumerate(("a", "b", "c")):
        assert nets.take(key, False)[1]
        nets.started(pid, key, False)
    nets.take("a", False)  # "a" is now the most recently used; "b" the least
    # all three busy: a fourth key's jail gets a namespace kept by no one
    assert nets.take("d", False) == (104, False)
    assert nets.closed == []
    nets.ended(1)  # "b"'s jail ended
    assert nets.take("d", False) == (105, True)
    assert nets.closed == [102]  # "b"'s went
    assert nets.take("a", False) == (101, True)  # the busy ones stay
    assert nets.take("c", False) == (103, True)


def test_a_jail_of_a_kept_namespace_is_counted_until_reaped(nets: FakeNets) -> None:
    nets.take("a", False)
    nets.started(10, "a", False)
    nets.started(11, "a", False)
    nets.ended(10)
    nets.ended(99)  # a jail that joined nothing
    for key in ("b", "c"):
        nets.take(key, False)
    assert nets.take("d", False)[1] is True
    assert 101 not in nets.closed  # "a" still has jail 11; "b" went instead
    assert nets.closed == [102]


# ------------------------------------------------------------------------ the bench's policy


def test_the_benchs_policy_is_the_default_one_sharing_its_tenants_namespace() -> None:
    repo = Path(__file__).resolve().parents[2]
    bench = load_policy_text((repo / "bench/shared-netns.toml").read_text(), "/p/default.toml")
    default = load_policy_text((repo / "policies/default.toml").read_text(), "/p/default.toml")
    assert bench.network.namespace == "tenant"
    assert dataclasses.replace(bench, network=default.network) == default
