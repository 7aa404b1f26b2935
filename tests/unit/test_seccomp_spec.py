"""The seccomp spec a policy compiles to, and the BPF libseccomp makes of it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from jaild.errors import PolicyError
from jaild.policy.schema import load_policy_text
from jaild.policy.seccomp import (
    CLONE_NAMESPACE_FLAGS,
    CLONE_THREAD,
    TIOCLINUX,
    TIOCSTI,
    SeccompChoice,
    SyscallNameError,
    allowed_syscalls,
    build_spec,
    network_refusal,
)
from jaild.policy.syscalls import (
    ARGUMENT_VALUES,
    GROUPS,
    NETWORK_FAMILIES,
    NEVER,
    PROFILES,
    SOFT_CLOSED,
)
from jaild.runtime.seccomp import bpf_program, explain, refuses, syscall_name, syscall_number

POLICIES_DIR = Path(__file__).resolve().parents[2] / "policies"

DEFAULT = SeccompChoice("default", "kill", (), ())
STRICT = SeccompChoice("strict", "kill", (), ())

MUST_DENY = [
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "fsopen", "fsmount",
    "move_mount", "open_tree", "fspick", "fsconfig", "mount_setattr",
]


def rules_of(spec: dict, syscall: str, filter_index: int = 0) -> list:  # type: ignore[type-arg]
    return [r for r in spec["filters"][filter_index]["rules"] if r[0] == syscall]


def test_every_group_member_is_a_real_syscall() -> None:
    for group, names in GROUPS.items():
        for name in names:
            assert syscall_number(name) is not None or name in ARGUMENT_VALUES, f"{group}: {name}"
    for name in NEVER:
        assert syscall_number(name) is not None or name in ("_sysctl", "vm86", "vm86old", "nfsservctl", "uselib"), name


@pytest.mark.parametrize("choice", [DEFAULT, STRICT])
def test_dangerous_syscalls_are_never_allowed(choice: SeccompChoice) -> None:
    spec = build_spec(choice, network=True)
    allowed = {r[0] for r in spec["filters"][0]["rules"] if r[1] == "allow"}
    for name in MUST_DENY:
        assert name not in allowed, name
    assert spec["filters"][0]["default"] == "kill"


def test_profiles_cannot_smuggle_never_syscalls() -> None:
    for profile in PROFILES:
        plain, _ = allowed_syscalls(SeccompChoice(profile, "kill", (), ()))
        assert not plain & set(NEVER)


def test_clone_only_without_namespace_flags() -> None:
    spec = build_spec(DEFAULT, network=False)
    assert rules_of(spec, "clone") == [["clone", "allow", [[0, "masked_eq", CLONE_NAMESPACE_FLAGS, 0]]]]
    assert rules_of(spec, "clone3") == [["clone3", "errno:38", []]]  # ENOSYS: glibc falls back


def test_strict_allows_threads_only() -> None:
    spec = build_spec(STRICT, network=False)
    assert rules_of(spec, "clone") == [
        ["clone", "allow", [[0, "masked_eq", CLONE_NAMESPACE_FLAGS | CLONE_THREAD, CLONE_THREAD]]]
    ]
    allowed = {r[0] for r in spec["filters"][0]["rules"] if r[1] == "allow"}
    for name in ("execve", "fork", "vfork", "socket", "shmget"):
        assert name not in allowed, name
    refused = {r[0] for r in spec["filters"][0]["rules"] if r[1] != "allow"}
    assert not refused & {"execve", "fork", "vfork", "shmget"}  # the action decides: kill


def families(spec: dict, syscall: str) -> list[tuple[int, str]]:  # type: ignore[type-arg]
    """(family, action) of each rule for ``syscall``; each rule has one condition, on arg 0."""
    rules = rules_of(spec, syscall)
    assert all(len(r[2]) == 1 and r[2][0][:2] == [0, "eq"] for r in rules), rules
    return [(r[2][0][2], r[1]) for r in rules]


EACCES = "errno:13"


@pytest.mark.parametrize("syscall", ["socket", "socketpair"])
def test_socket_families_follow_the_network_mode(syscall: str) -> None:
    """With a network: AF_UNIX, AF_INET, AF_INET6. Without: AF_UNIX, and the network's
    families refused with EACCES (no kill); any other family gets the policy's action."""
    assert families(build_spec(DEFAULT, network=True), syscall) == [
        (1, "allow"), (2, "allow"), (10, "allow")]
    assert families(build_spec(DEFAULT, network=False), syscall) == [
        (1, "allow"), (2, EACCES), (10, EACCES)]
    assert build_spec(DEFAULT, network=False)["filters"][0]["default"] == "kill"


@pytest.mark.parametrize("choice", [DEFAULT, STRICT, SeccompChoice("default", "errno", (), ()),
                                    SeccompChoice("default", "kill", (), ("socket",))])
def test_without_a_network_inet_is_refused_softly_whatever_the_action_and_profile(
        choice: SeccompChoice) -> None:
    """A network attempt never kills: not under strict (which has no socket() at all), not
    when a policy removes socket(), and under the errno action with EACCES, not its EPERM."""
    spec = build_spec(choice, network=False)
    for syscall in ("socket", "socketpair"):
        soft = [(f, a) for f, a in families(spec, syscall) if a != "allow"]
        assert soft == [(2, EACCES), (10, EACCES)], (choice, syscall)
    assert list(NETWORK_FAMILIES.values()) == [2, 10]


@pytest.mark.parametrize("choice", [DEFAULT, STRICT])
def test_the_dangerous_families_are_never_allowed_nor_soft(choice: SeccompChoice) -> None:
    """AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK, ... have no rule at all: the default action
    (kill) takes them, with or without a network."""
    for network in (False, True):
        spec = build_spec(choice, network=network)
        for syscall in ("socket", "socketpair"):
            assert {f for f, _ in families(spec, syscall)} <= {1, 2, 10}
        assert spec["filters"][0]["default"] == "kill"


def test_strict_socketpair_is_af_unix_only_and_socket_absent() -> None:
    spec = build_spec(STRICT, network=False)
    assert families(spec, "socketpair") == [(1, "allow"), (2, EACCES), (10, EACCES)]
    assert families(spec, "socket") == [(2, EACCES), (10, EACCES)]  # no AF_UNIX socket()
    # @network-io on top of strict brings socketpair back filtered, never unconditionally
    widened = build_spec(SeccompChoice("strict", "kill", ("@network-io",), ()), network=False)
    assert families(widened, "socketpair") == [(1, "allow"), (2, EACCES), (10, EACCES)]


def test_network_refusal_names_the_policy_and_the_way_to_the_network() -> None:
    refusal = network_refusal("default", "none")
    assert refusal is not None
    assert refusal.families == (2, 10)
    text = refusal.explanation
    assert "policy 'default' has no network (network.mode = \"none\")" in text
    assert 'network.mode = "egress"' in text and "[egress] allow" in text
    for mode in ("loopback", "host", "egress"):
        assert network_refusal("web", mode) is None  # nothing to refuse softly


SIDE_CHANNEL_SYSCALLS = ["sysinfo", "flock", "memfd_create", "inotify_init", "inotify_init1",
                         "inotify_add_watch", "inotify_rm_watch"]


@pytest.mark.parametrize("choice", [DEFAULT, STRICT, SeccompChoice("default", "errno", (), ())])
def test_side_channels_are_closed_softly_in_every_profile(choice: SeccompChoice) -> None:
    spec = build_spec(choice, network=False)
    for name in SIDE_CHANNEL_SYSCALLS:
        assert [r[1] for r in rules_of(spec, name)] == [f"errno:{38 if name != 'sysinfo' else 1}"], name
    assert rules_of(spec, "fcntl") == [["fcntl", "allow", []]]
    assert rules_of(spec, "fcntl", 1) == [
        ["fcntl", "errno:1", [[1, "masked_eq", 0xFFFFFFFF, cmd]]] for cmd in (5, 36, 1026)
    ]  # F_GETLK, F_OFD_GETLK, F_NOTIFY; F_SETLK & co. stay open
    assert rules_of(spec, "fadvise64") == [["fadvise64", "allow", []]]
    assert rules_of(spec, "fadvise64", 1) == [
        ["fadvise64", "errno:1", [[3, "masked_eq", 0xFFFFFFFF, 4]]]  # POSIX_FADV_DONTNEED only
    ]


def test_page_cache_eviction_can_be_reopened() -> None:
    spec = build_spec(SeccompChoice("default", "kill", ("@page-cache",), ()), network=False)
    assert rules_of(spec, "fadvise64", 1) == []
    assert len(rules_of(spec, "fcntl", 1)) == 3


@pytest.mark.parametrize(("group", "names", "commands"), [
    ("@inotify", ["inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch"], [1026]),
    ("@file-locks", ["flock"], [5, 36]),
    ("@memfd", ["memfd_create"], []),
])
def test_a_policy_can_reopen_each_side_channel_group(group: str, names: list[str],
                                                     commands: list[int]) -> None:
    spec = build_spec(SeccompChoice("strict", "kill", (group,), ()), network=False)
    for name in names:
        assert rules_of(spec, name) == [[name, "allow", []]], name
    closed = [r[2][0][3] for r in rules_of(spec, "fcntl", 1)]
    assert not set(commands) & set(closed)
    assert set(closed) | set(commands) == {5, 36, 1026}


def test_sysinfo_can_be_reopened_by_name() -> None:
    spec = build_spec(SeccompChoice("default", "kill", ("sysinfo",), ()), network=False)
    assert rules_of(spec, "sysinfo") == [["sysinfo", "allow", []]]


def test_fcntl_commands_are_named_like_syscalls() -> None:
    spec = build_spec(SeccompChoice("default", "kill", ("fcntl:F_GETLK",), ()), network=False)
    assert [r[2][0][3] for r in rules_of(spec, "fcntl", 1)] == [36, 1026]
    assert all(name in SOFT_CLOSED for name in ARGUMENT_VALUES)
    with pytest.raises(SyscallNameError, match="unknown syscall 'fcntl:F_SETLK'"):
        allowed_syscalls(SeccompChoice("default", "kill", ("fcntl:F_SETLK",), ()))
    with pytest.raises(SyscallNameError, match="unknown syscall group '@inotfy'"):
        allowed_syscalls(SeccompChoice("default", "kill", ("@inotfy",), ()))


def test_side_channel_rules_compile_to_bpf() -> None:
    """libseccomp accepts both the closed and the re-opened forms (a rule it refused would
    fail every jail's hardening)."""
    for choice in (DEFAULT, STRICT, SeccompChoice("default", "errno", (), ()),
                   SeccompChoice("strict", "kill", ("sysinfo", "@inotify", "@file-locks", "@memfd"), ())):
        for network in (True, False):  # without one: the refused inet families' rules too
            assert len(bpf_program(build_spec(choice, network=network))) == 2


def test_tiocsti_is_denied_on_the_low_32_bits_in_a_separate_filter() -> None:
    spec = build_spec(DEFAULT, network=False)
    assert len(spec["filters"]) == 2
    deny = spec["filters"][1]
    assert deny["default"] == "allow"
    assert rules_of(spec, "ioctl", 1) == [
        ["ioctl", "kill", [[1, "masked_eq", 0xFFFFFFFF, TIOCSTI]]],
        ["ioctl", "kill", [[1, "masked_eq", 0xFFFFFFFF, TIOCLINUX]]],
    ]


def test_errno_action() -> None:
    spec = build_spec(SeccompChoice("default", "errno", (), ()), network=False)
    assert spec["filters"][0]["default"] == "errno"
    assert spec["filters"][1]["rules"][0][1] == "errno"


def test_allow_and_deny_adjust_the_profile() -> None:
    plain, _ = allowed_syscalls(SeccompChoice("strict", "kill", ("execve", "@sysv-ipc"), ("mkdir",)))
    assert "execve" in plain and "shmget" in plain and "mkdir" not in plain
    _, conditional = allowed_syscalls(SeccompChoice("default", "kill", (), ("socket",)))
    assert "socket" not in conditional
    with pytest.raises(SyscallNameError, match="can never be allowed"):
        allowed_syscalls(SeccompChoice("default", "kill", ("bpf",), ()))


def test_bpf_has_the_architecture_and_x32_guard() -> None:
    program = bpf_program(build_spec(DEFAULT, network=False))[0]
    insns = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    constants = {k for _, _, _, k in insns}
    assert 0xC000003E in constants  # AUDIT_ARCH_X86_64 checked
    assert 0x40000000 in constants  # x32 syscall numbers rejected
    assert 0x80000000 in constants  # SECCOMP_RET_KILL_PROCESS


def test_explain_is_readable() -> None:
    text = explain(build_spec(STRICT, network=False))
    assert "filter 1 of 2" in text and 'syscall "read"' in text


def test_syscall_names_resolve_both_ways() -> None:
    assert syscall_name(syscall_number("unshare") or -1) == "unshare"
    assert syscall_number("not_a_syscall") is None


@pytest.mark.parametrize(("allow", "message"), [
    ("'@inotfy'", "p.toml: seccomp.allow: unknown syscall group '@inotfy'; known: ["),
    ("'fcntl:F_SETLK'", "p.toml: seccomp.allow: unknown syscall 'fcntl:F_SETLK'"),
    ("'@memfd', 3", "p.toml: seccomp.allow[1]: must be a string, got 3"),
    ("'fcntl:F_NOTIFY', 'ptrace'", "p.toml: seccomp.allow: 'ptrace' can never be allowed"),
])
def test_a_bad_group_value_names_the_file_and_key(allow: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(f"[seccomp]\nallow = [{allow}]\n", "/etc/jaild/policies/p.toml")
    assert message in str(info.value)


def test_shipped_policies_leave_the_side_channels_closed_and_a_policy_can_open_them() -> None:
    for path in sorted(POLICIES_DIR.glob("*.toml")):
        policy = load_policy_text(path.read_text(), str(path))
        spec = build_spec(policy.seccomp_choice, network=policy.network.mode != "none")
        for name in ["sysinfo", "flock", "memfd_create", "inotify_init1"]:
            assert refuses(spec, name), (path.name, name)
    opened = load_policy_text('[seccomp]\nallow = ["sysinfo", "@inotify", "@file-locks", "@memfd"]\n',
                              "/etc/jaild/policies/open.toml")
    spec = build_spec(opened.seccomp_choice, network=False)
    assert not any(refuses(spec, n) for n in ["sysinfo", "flock", "memfd_create", "inotify_init1"])


def test_the_docs_name_every_group_and_fcntl_command() -> None:
    docs = POLICIES_DIR.parent / "docs"
    policies = (docs / "running/policies.md").read_text()
    paragraph = policies[policies.index("Syscall groups (") :].split("\n\n")[0]
    for name in [*GROUPS, *ARGUMENT_VALUES, "sysinfo"]:
        assert f"`{name}`" in paragraph, name
    security = (docs / "security.md").read_text()
    checked = security[security.index("## System calls checked") :]
    for name in ["socketpair", "sysinfo", "flock", "memfd_create", "fcntl", "clone3", "prctl"]:
        assert f"`{name}`" in checked, name
