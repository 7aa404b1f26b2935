"""The seccomp spec a policy compiles to, and the BPF libseccomp makes of it."""

from __future__ import annotations

import struct

import pytest

from jaild.policy.seccomp import (
    CLONE_NAMESPACE_FLAGS,
    CLONE_THREAD,
    TIOCLINUX,
    TIOCSTI,
    SeccompChoice,
    SyscallNameError,
    allowed_syscalls,
    build_spec,
)
from jaild.policy.syscalls import GROUPS, NEVER, PROFILES
from jaild.runtime.seccomp import bpf_program, explain, syscall_name, syscall_number

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
            assert syscall_number(name) is not None, f"{group}: {name}"
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
    allowed = {r[0] for r in spec["filters"][0]["rules"]}
    for name in ("execve", "fork", "vfork", "socket", "shmget"):
        assert name not in allowed, name


def test_socket_families_follow_the_network_mode() -> None:
    no_net = [r[2][0][2] for r in rules_of(build_spec(DEFAULT, network=False), "socket")]
    net = [r[2][0][2] for r in rules_of(build_spec(DEFAULT, network=True), "socket")]
    assert no_net == [1]  # AF_UNIX only
    assert net == [1, 2, 10]  # + AF_INET, AF_INET6


def test_tiocsti_is_denied_on_the_low_32_bits_in_a_separate_filter() -> None:
    spec = build_spec(DEFAULT, network=False)
    assert len(spec["filters"]) == 2
    deny = spec["filters"][1]
    assert deny["default"] == "allow"
    assert deny["rules"] == [
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
