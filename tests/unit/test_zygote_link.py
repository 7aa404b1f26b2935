"""The daemon <-> zygote link: its messages, their checks, their framing, and the zygote
applying exactly the plan it is sent (root-free: the plan's steps against a model of the
mount table; the integration and hostile suites run the real thing).

Every input is fed whole and one byte at a time. Every hostile input has its positive
control: the same message without the defect is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaild.errors import FrameTooLarge, LocalProtocolError, RemoteProtocolError
from jaild.policy.compile import (
    CgroupLayout,
    HostLayout,
    JailPlan,
    JobFacts,
    compile_policy,
    compile_zygote,
    forked_jail,
    harden,
)
from jaild.policy.schema import Policy, load_policy_dir, load_policy_text
from jaild.policy.seccomp import build_spec
from jaild.protocol import messages
from jaild.protocol.framing import HEADER, HEADER_BYTES
from jaild.protocol.messages import Harden, Message
from jaild.protocol.messages import encode as encode_message
from jaild.protocol.zygote_link import (
    MAX_FAILED_IMPORTS,
    MAX_FAILURE_CHARS,
    MAX_FRAME_BYTES,
    MESSAGES,
    JailReaped,
    JailSetup,
    LinkDecoder,
    Mount,
    PrepareJails,
    Rlimits,
    SpawnFailed,
    SpawnJail,
    ZygoteReady,
    decode,
    decode_packet,
    encode,
)
from jaild.runtime import zygote
from jaild.runtime.zygote import MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY, SetupFailed, Step

REPO = Path(__file__).resolve().parents[2]
POLICIES = load_policy_dir(REPO / "policies")
HOST = HostLayout("/var/lib/jaild/runtime/0123", "/var/lib/jaild/envs", CgroupLayout(2, "jaild"))
UID_BASE = 1073741824
JOB_UID = UID_BASE + 42
FEEDS = ["whole", "bytewise"]


def sent(policy: Policy, *, pooled: bool = False) -> JailSetup:
    return forked_jail(policy, HOST, JobFacts(policy.limits, JOB_UID, pooled=pooled))


def examples() -> list[Message]:
    policy = POLICIES["default"]
    return [
        ZygoteReady(pid=1, python="3.11.2"),
        ZygoteReady(pid=7, python="3.12.0", failed={"numpy": "ModuleNotFoundError: numpy"}),
        PrepareJails(encode_message(harden(policy, build_spec(policy.seccomp_choice, network=False)))),
        *(SpawnJail(n, sent(p, pooled=n % 2 == 0)) for n, p in enumerate(POLICIES.values())),
        JailReaped(spawn_id=3, status=0, cpu_s=0.25, maxrss_kb=20480),
        JailReaped(spawn_id=(1 << 63) - 1, status=9, cpu_s=0, maxrss_kb=0),
        SpawnFailed(spawn_id=4, message="fork: [Errno 11] Resource temporarily unavailable"),
    ]


def direction(msg: Message) -> Any:
    return next(d for d, table in MESSAGES.items() if type(msg) in table.values())


# ------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("how", FEEDS)
def test_every_message_round_trips(how: str) -> None:
    msgs = examples()
    assert {type(m) for m in msgs} == {m for t in MESSAGES.values() for m in t.values()}
    for msg in msgs:
        packet = encode(msg)
        assert packet[:HEADER_BYTES] == (len(packet) - HEADER_BYTES).to_bytes(4, "big")
        decoder = LinkDecoder(direction(msg))
        if how == "whole":
            decoder.feed(packet)
            got = decoder.next_message()
        else:
            got = None
            for i in range(len(packet)):
                assert got is None  # not a byte early
                decoder.feed(packet[i : i + 1])
                got = decoder.next_message()
        assert got == msg and decoder.buffered_bytes == 0
        assert decode_packet(packet, direction(msg)) == msg


def test_several_messages_in_one_stream() -> None:
    msgs = [m for m in examples() if direction(m) == "zygote->daemon"]
    decoder = LinkDecoder("zygote->daemon")
    decoder.feed(b"".join(encode(m) for m in msgs))
    got = []
    while (msg := decoder.next_message()) is not None:
        got.append(msg)
    assert got == msgs


def test_the_plan_crosses_the_link_as_it_is() -> None:
    for policy in POLICIES.values():
        jail = sent(policy)
        got = decode_packet(encode(SpawnJail(9, jail)), "daemon->zygote")
        assert isinstance(got, SpawnJail) and got.jail == jail and got.spawn_id == 9
        assert zygote.jail_steps(got.jail) == zygote.jail_steps(jail)


# ------------------------------------------------------------------------ validation


def test_messages_validate_themselves() -> None:
    jail = sent(POLICIES["default"])
    SpawnJail(1, jail)  # positive control
    with pytest.raises(LocalProtocolError, match="rlimits"):
        SpawnJail(1, dataclasses.replace(jail, rlimits=None))
    with pytest.raises(LocalProtocolError, match="user namespace"):
        SpawnJail(1, dataclasses.replace(jail, namespaces=(*jail.namespaces, "user")))
    with pytest.raises(LocalProtocolError, match="pid 1"):
        SpawnJail(1, dataclasses.replace(jail, namespaces=("mount", "ipc")))
    bind = Mount("/data", "bind", source="/srv")
    with pytest.raises(LocalProtocolError, match="not bind"):
        SpawnJail(1, dataclasses.replace(jail, mounts=(*jail.mounts, bind)))
    with pytest.raises(LocalProtocolError, match="spawn_id"):
        SpawnJail(-1, jail)
    with pytest.raises(LocalProtocolError, match="duplicates"):
        dataclasses.replace(jail, namespaces=("pid", "pid"))
    with pytest.raises(LocalProtocolError, match="loopback"):
        dataclasses.replace(jail, namespaces=("pid",), loopback=True)
    with pytest.raises(LocalProtocolError, match="uid"):
        dataclasses.replace(jail, uid=-1)


def test_mounts_validate_themselves() -> None:
    Mount("/tmp", "tmpfs", options="size=1")  # positive controls
    Mount("/usr", "bind", source="/usr")
    with pytest.raises(LocalProtocolError, match="takes no source"):
        Mount("/tmp", "tmpfs", source="/x")
    with pytest.raises(LocalProtocolError, match="takes a source"):
        Mount("/usr", "bind")
    with pytest.raises(LocalProtocolError, match="takes none"):
        Mount("/usr", "bind", source="/usr", options="size=1")
    with pytest.raises(LocalProtocolError, match="target"):
        Mount("tmp", "tmpfs")
    with pytest.raises(LocalProtocolError, match="kind"):
        Mount("/sys", "sysfs")
    with pytest.raises(LocalProtocolError, match="writable"):
        Mount("/tmp", "tmpfs", writable=1)  # type: ignore[arg-type]


def test_ready_reports_a_bounded_list_of_failures() -> None:
    many = {f"m{i}": "x" * MAX_FAILURE_CHARS for i in range(MAX_FAILED_IMPORTS)}
    assert len(encode(ZygoteReady(pid=1, failed=many))) < MAX_FRAME_BYTES
    with pytest.raises(LocalProtocolError, match="entries"):
        ZygoteReady(pid=1, failed={**many, "one": "more"})
    with pytest.raises(LocalProtocolError, match="length"):
        ZygoteReady(pid=1, failed={"m": "x" * (MAX_FAILURE_CHARS + 1)})


def wire(msg: Message, **changes: Any) -> bytes:
    data = msg.to_wire()
    data.update(changes)
    return msgpack.packb(data, use_bin_type=True)


HOSTILE: list[tuple[str, bytes, str]] = [
    ("daemon->zygote", wire(SpawnJail(1, sent(POLICIES["default"])), spawn_id="1"), "integer"),
    ("daemon->zygote", wire(SpawnJail(1, sent(POLICIES["default"])), extra=1), "unknown"),
    ("daemon->zygote", wire(PrepareJails(b"a"), type="Spawn"), "unknown message type"),
    ("zygote->daemon", wire(SpawnFailed(1, "x"), type="SpawnJail"), "unknown message type"),
    ("zygote->daemon", wire(JailReaped(1, 0, 0.0, 0), cpu_s=float("nan")), "cpu_s"),
    ("zygote->daemon", wire(JailReaped(1, 0, 0.0, 0), status=None), "status"),
    ("zygote->daemon", msgpack.packb([1, 2]), "must be a map"),
    ("zygote->daemon", b"\xc1", "undecodable"),
    ("zygote->daemon", msgpack.packb({"type": "ZygoteReady"}), "missing"),
]


@pytest.mark.parametrize(("way", "payload", "why"), HOSTILE)
def test_hostile_payloads_are_remote_errors(way: Any, payload: bytes, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        decode(payload, way)


def test_hostile_payloads_positive_controls() -> None:
    jail = sent(POLICIES["default"])
    assert isinstance(decode(wire(SpawnJail(1, jail)), "daemon->zygote"), SpawnJail)
    assert isinstance(decode(wire(JailReaped(1, 0, 0.0, 0)), "zygote->daemon"), JailReaped)


def test_a_nested_plan_error_is_a_remote_error() -> None:
    good = SpawnJail(1, sent(POLICIES["default"])).to_wire()
    good["jail"]["mounts"][0]["kind"] = "tmpfs"  # positive control
    decode(msgpack.packb(good), "daemon->zygote")
    good["jail"]["mounts"][0]["kind"] = "bind"
    with pytest.raises(RemoteProtocolError, match="source"):
        decode(msgpack.packb(good), "daemon->zygote")


@pytest.mark.parametrize("how", FEEDS)
def test_a_packet_holds_exactly_one_frame(how: str) -> None:
    packet = encode(SpawnFailed(1, "no"))
    assert isinstance(decode_packet(packet, "zygote->daemon"), SpawnFailed)  # positive control
    for bad in (packet + b"\x00", packet[:-1], packet + packet, packet[:3]):
        with pytest.raises(RemoteProtocolError, match="packet"):
            decode_packet(bad, "zygote->daemon")
    huge = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(FrameTooLarge):
        decode_packet(huge + b"\x00" * (MAX_FRAME_BYTES + 1), "zygote->daemon")
    decoder = LinkDecoder("zygote->daemon")
    chunks = [huge] if how == "whole" else [huge[i : i + 1] for i in range(4)]
    with pytest.raises(FrameTooLarge):
        for chunk in chunks:
            decoder.feed(chunk)
            decoder.next_message()


def test_too_large_to_send() -> None:
    with pytest.raises(LocalProtocolError, match="harden"):
        PrepareJails(b"y" * MAX_FRAME_BYTES)


# ------------------------------------------------------------------------ the zygote applies it


def flags(mount: Mount) -> int:
    out = 0 if mount.writable else MS_RDONLY
    return out | (MS_NOSUID * mount.nosuid) | (MS_NODEV * mount.nodev) | (MS_NOEXEC * mount.noexec)


def table(mounts: tuple[Mount, ...]) -> dict[str, tuple[str, int, str]]:
    return {m.target: (m.kind, flags(m), m.options) for m in mounts}


def run_steps(steps: list[Step], zygote_plan: JailPlan) -> dict[str, Any]:
    """Play ``steps`` against a model of the kernel: the zygote's fresh mounts (the frame
    is shared and untouched), detaches, mounts and moves; and the rest of the process."""
    mounts = table(zygote_plan.jail.mounts)
    state: dict[str, Any] = {"rlimits": {}, "order": [s.op for s in steps]}
    for step in steps:
        args = step.args
        if step.op == "umount":
            assert args[0] in mounts, f"detaches {args[0]}, which the zygote does not mount"
            del mounts[args[0]]
        elif step.op == "mount":
            source, target, fstype, mflags, data = args
            assert source == fstype
            mounts[target] = (fstype, mflags, data)
        elif step.op == "move":
            assert args[1] not in mounts, "moved over a mount still in place"
            mounts[args[1]] = mounts.pop(args[0])
        elif step.op == "rlimit":
            state["rlimits"][args[0]] = (args[1], args[2])
        elif step.op in ("hostname", "chdir", "become", "unshare"):
            state[step.op] = args[0]
        else:
            state.setdefault(step.op, []).append(args)
    state["mounts"] = mounts
    return state


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("proc", ["pid-only", "full", "none"])
@pytest.mark.parametrize("shm_mb", [0, 16])
@pytest.mark.parametrize("network", ["none", "loopback", "host"])
def test_the_zygote_applies_exactly_the_plan(name: str, proc: str, shm_mb: int,
                                             network: str) -> None:
    base = POLICIES[name]
    policy = dataclasses.replace(
        base,
        filesystem=dataclasses.replace(base.filesystem, proc=proc, shm_mb=shm_mb),
        network=dataclasses.replace(base.network, mode=network),
    )
    job = JobFacts(policy.limits, JOB_UID)
    spawned = compile_policy(policy, HOST, job)
    jail = compile_policy(policy, HOST, job, forked=True).jail
    made = run_steps(zygote.jail_steps(jail), compile_zygote(policy, HOST))
    # the jail ends with the mounts a spawned jail of the same plan has
    assert made["mounts"] == table(spawned.jail.mounts)
    lim = policy.limits
    assert made["rlimits"] == {
        resource.RLIMIT_CPU: (lim.cpu_time_s,) * 2,
        resource.RLIMIT_FSIZE: (lim.file_size_mb << 20,) * 2,
        resource.RLIMIT_NOFILE: (lim.open_files,) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_SIGPENDING: (64, 64),
        resource.RLIMIT_MSGQUEUE: (1024, 1024),
        resource.RLIMIT_MEMLOCK: (16 * 1024,) * 2,
    }
    assert (made["hostname"], made["chdir"], made["become"]) == ("jail", "/tmp", JOB_UID)
    wanted = zygote.CLONE_NEWNS | zygote.CLONE_NEWIPC | zygote.CLONE_NEWUTS
    wanted |= zygote.CLONE_NEWCGROUP | (zygote.CLONE_NEWNET if network != "host" else 0)
    assert made["unshare"] == wanted
    assert ("loopback_up" in made) == (network == "loopback")
    order = made["order"]
    assert order[:2] == ["unshare", "private"] and order[-1] == "become"  # privileges go last
    assert order.index("chdir") > max(i for i, op in enumerate(order) if op in ("mount", "move"))


def test_a_plan_a_forked_jail_cannot_follow_is_refused() -> None:
    jail = sent(POLICIES["default"])
    zygote.jail_steps(jail)  # positive control
    for bad in (
        dataclasses.replace(jail, namespaces=(*jail.namespaces, "user")),
        dataclasses.replace(jail, namespaces=("mount",)),
        dataclasses.replace(jail, rlimits=None),
        dataclasses.replace(jail, mounts=(Mount("/x", "bind", source="/y"),)),
    ):
        with pytest.raises(SetupFailed):
            zygote.jail_steps(bad)


def test_each_step_is_one_system_call(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = zygote.jail_steps(sent(load_policy_text("[network]\nmode = 'loopback'\n", "l.toml")))
    shared = load_policy_text("[network]\nnamespace = 'tenant'\n", "t.toml")
    joins = zygote.jail_steps(forked_jail(shared, HOST, JobFacts(shared.limits, JOB_UID,
                                                                   tenant="1000")))
    # every kind of step, at least once
    assert {s.op for s in [*steps, *joins]} == set(zygote.APPLY)
    calls: list[Step] = []
    for op in zygote.APPLY:
        monkeypatch.setitem(zygote.APPLY, op, lambda *a, op=op: calls.append(Step(op, a)))
    zygote._apply(steps)
    assert calls == steps


def test_a_spawn_the_zygote_cannot_fork_is_answered() -> None:
    daemon_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with daemon_end, zygote_end:
        req = zygote.Plans().read(encode(SpawnJail(5, sent(POLICIES["default"]))))
        assert isinstance(req, zygote.Spawn)
        nets = zygote.SharedNets(-1)
        forker = zygote.Forker("unused")
        assert zygote._spawn(zygote_end, req, [], -1, nets, forker) == {}  # no fds
        reply = decode_packet(daemon_end.recv(1 << 17), "zygote->daemon")
        assert isinstance(reply, SpawnFailed) and reply.spawn_id == 5
        assert "channel, stdout, stderr" in reply.message


def test_rlimits_units_are_in_their_names() -> None:
    policy = POLICIES["default"]
    rl = sent(policy).rlimits
    assert rl == Rlimits(
        cpu_s=policy.limits.cpu_time_s,
        file_size_bytes=policy.limits.file_size_mb * 1024 * 1024,
        open_files=policy.limits.open_files,
        core_bytes=0,
        sigpending=64,
        msgqueue_bytes=1024,
        memlock_bytes=16 * 1024,
    )


# ------------------------------------------------------------------------ the daemon's side


def test_the_daemon_checks_the_zygote_against_its_plans_namespaces() -> None:
    from jaild.daemon.jails.launch.forked import namespace_problem

    plan = compile_zygote(POLICIES["default"], HOST)
    # this process shares its own namespaces: every one of the plan's is named
    problem = namespace_problem(os.getpid(), plan.jail.namespaces)
    assert problem is not None
    assert "shares the daemon's user, mnt, pid, ipc, uts, cgroup, net namespace(s)" in problem
    assert namespace_problem(os.getpid(), ()) is None  # positive control: nothing asked
    gone = namespace_problem(2**22 + 1, plan.jail.namespaces)  # above pid_max: no such process
    assert gone is not None and "cannot inspect" in gone


# ------------------------------------------------------------------------ the receive boundary

_MAPS = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
_TYPES = st.sampled_from([*{t for table in MESSAGES.values() for t in table}, "spawn", ""])


@settings(max_examples=300, deadline=None)
@given(way=st.sampled_from(sorted(MESSAGES)), kind=_TYPES,
       fields=st.dictionaries(st.text(max_size=12), _MAPS, max_size=6), junk=st.binary(max_size=64))
def test_any_packet_is_a_message_or_a_remote_error(way: Any, kind: str, fields: dict[str, Any],
                                                   junk: bytes) -> None:
    """h11's invariant for this link: whatever a packet holds, the receiver gets a message
    of its direction or a RemoteProtocolError -- never anything else."""
    payload = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    for packet in (len(payload).to_bytes(4, "big") + payload, junk):
        try:
            msg = decode_packet(packet, way)
        except RemoteProtocolError:
            continue
        assert type(msg) in MESSAGES[way].values()


# ------------------------------------------------------------------------ the remembered Harden


def test_a_jail_knows_its_zygotes_harden_by_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a zygote remembers (PrepareJails) answers a decode of the very same bytes with
    the very same message; anything else -- one byte changed, another direction -- is
    decoded and checked as ever."""
    monkeypatch.setattr(messages, "_remembered", None)
    policy = POLICIES["default"]
    msg = harden(policy, build_spec(policy.seccomp_choice, network=False))
    payload = encode_message(msg)
    kept = messages.remember(payload, "daemon->jail")
    assert kept == msg
    assert messages.decode(bytes(payload), "daemon->jail") is kept
    assert messages.decode(bytearray(payload), "daemon->jail") is kept
    other = encode_message(harden(policy, build_spec(policy.seccomp_choice, network=True)))
    assert other != payload
    decoded = messages.decode(other, "daemon->jail")
    assert isinstance(decoded, Harden) and decoded is not kept and decoded != kept
    with pytest.raises(RemoteProtocolError, match="unknown message type"):
        messages.decode(payload, "jail->daemon")
    broken = payload[:-1] + b"\xc1"
    with pytest.raises(RemoteProtocolError):
        messages.decode(broken, "daemon->jail")


def test_a_zygote_refuses_to_prepare_anything_but_a_harden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(messages, "_remembered", None)
    ready = encode_message(messages.JailReady(protocol=1))
    with pytest.raises(RemoteProtocolError):  # not even a daemon->jail message
        zygote._prepare(PrepareJails(ready))
    run = encode_message(messages.RunCode(job=messages.JobDescription(code="1"),
                                          tool_payload_bytes=1, result_bytes=1))
    with pytest.raises(SetupFailed, match="not a Harden"):
        zygote._prepare(PrepareJails(run))


# ------------------------------------------------------------------------ the zygote's plans


def test_a_plan_seen_before_is_not_read_again_but_its_uid_is() -> None:
    plans = zygote.Plans()
    policy = POLICIES["default"]
    first = plans.read(encode(SpawnJail(1, sent(policy))))
    assert isinstance(first, zygote.Spawn) and not isinstance(first.steps, SetupFailed)
    assert first.steps == zygote.jail_steps(sent(policy))
    other_uid = dataclasses.replace(sent(policy), uid=JOB_UID + 1)
    again = plans.read(encode(SpawnJail(2, other_uid)))
    assert isinstance(again, zygote.Spawn) and again.spawn_id == 2
    assert again.steps == zygote.jail_steps(other_uid)  # the same steps, its own uid
    assert again.steps[-1] == Step("become", (JOB_UID + 1,))
    pooled = plans.read(encode(SpawnJail(3, sent(policy, pooled=True))))
    assert isinstance(pooled, zygote.Spawn) and pooled.warm_up and not again.warm_up
    # a known plan with a uid or an id out of range is read in full, and refused
    wire = msgpack.unpackb(encode(SpawnJail(4, other_uid))[HEADER_BYTES:])
    for field_name, bad in (("uid", -1), ("uid", "7"), ("spawn_id", -1)):
        broken = {**wire, "jail": dict(wire["jail"])}
        if field_name == "uid":
            broken["jail"]["uid"] = bad
        else:
            broken["spawn_id"] = bad
        packet = HEADER.pack(len(body := msgpack.packb(broken))) + body
        with pytest.raises(RemoteProtocolError, match=field_name):
            plans.read(packet)


def test_a_plan_a_zygote_cannot_follow_is_a_failed_spawn_and_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plans = zygote.Plans()
    jail = sent(POLICIES["default"])

    def refuse(_: JailSetup) -> list[Step]:
        raise SetupFailed("no")

    monkeypatch.setattr(zygote, "jail_steps", refuse)
    spawn = plans.read(encode(SpawnJail(1, jail)))
    assert isinstance(spawn, zygote.Spawn) and isinstance(spawn.steps, SetupFailed)
    monkeypatch.undo()
    again = plans.read(encode(SpawnJail(2, jail)))
    assert isinstance(again, zygote.Spawn) and isinstance(again.steps, list)


def test_the_zygotes_other_messages_pass_through_its_plans() -> None:
    prepare = PrepareJails(b"x")
    assert zygote.Plans().read(encode(prepare)) == prepare
    with pytest.raises(RemoteProtocolError):
        zygote.Plans().read(b"\x00\x00\x00\x01\xc1")


class _Refused:
    """A ``CloneInto`` the kernel refuses (as it does a zygote it does not let place)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def fork(self, cgroup_fd: int) -> int:
        self.calls.append(cgroup_fd)
        raise PermissionError(13, "Permission denied")


class _Cloned:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def fork(self, cgroup_fd: int) -> int:
        self.calls.append(cgroup_fd)
        return 4242


def _forker(monkeypatch: pytest.MonkeyPatch, cloner: Any) -> tuple[zygote.Forker, list[str]]:
    """A Forker whose fork(2) and log are the test's: what it chose, and what it said."""
    said: list[str] = []
    monkeypatch.setattr(zygote, "_fork_jail", lambda: 1717)
    monkeypatch.setattr(zygote.os, "write", lambda fd, data: said.append(f"{fd}:{data.decode()}"))
    return zygote.Forker(cloner), said


def test_a_jail_sent_its_cgroup_is_cloned_into_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cloned = _Cloned()
    forker, said = _forker(monkeypatch, cloned)
    assert forker.fork(9) == (4242, True) and cloned.calls == [9] and said == []
    assert forker.fork(None) == (1717, False) and cloned.calls == [9]  # none sent: fork(2)


def test_a_refused_clone_falls_back_to_fork_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = _Refused()
    forker, said = _forker(monkeypatch, refused)
    assert forker.fork(9) == (1717, False)  # the daemon then moves it (the jail says so)
    assert forker.fork(10) == (1717, False)
    assert refused.calls == [9, 10]  # tried each time: it costs one refused system call
    assert len(said) == 1 and said[0].startswith("2:jaild zygote: clone3 into the job's cgroup "
                                                 "failed: [Errno 13]"), said


def test_without_clone3_a_zygote_forks_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    forker, said = _forker(monkeypatch, "no clone3 numbers for riscv64")
    assert forker.fork(9) == (1717, False) and forker.fork(9) == (1717, False)
    assert said == ["2:jaild zygote: no clone3 numbers for riscv64; forking, and the daemon "
                    "moves each jail\n"]
