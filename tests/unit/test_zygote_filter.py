"""The zygote's filters and a jail's own, together, give every call the policy's verdict.

The proof runs the BPF programs libseccomp exports -- the policy's own beside the zygote's
then the jail's, loaded in that order -- through an interpreter of classic BPF with the
kernel's rule for several filters (tests/bpfsim.py), for every system call number of the
architecture, its x32 numbers and the i386 ones, and for every call the specs compare
arguments of, every value the comparisons tell apart: each compared value, its neighbours,
each bit of each mask flipped, and the extremes. For every shipped policy, for policies
generated from the compiler's own choices, and for raw specs generated with hypothesis; a
spec the split cannot rebuild must say so (and its jails load it whole), never differ.
"""

from __future__ import annotations

import errno
import itertools
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaild.errors import SeccompSpecError, Unsplittable
from jaild.policy.schema import load_policy
from jaild.policy.seccomp import SeccompChoice, build_spec
from jaild.policy.syscalls import GROUPS, NEVER, PROFILES
from jaild.runtime import seccomp
from jaild.runtime.zygote_filter import ZYGOTE_NEEDS, Split, split
from tests.bpfsim import (
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    SECCOMP_RET_ALLOW,
    X32_SYSCALL_BIT,
    Program,
    seccomp_data,
    verdict,
)

REPO = Path(__file__).resolve().parents[2]
POLICY_FILES = sorted([*REPO.glob("policies/*.toml"), *REPO.glob("tests/policies/*.toml")])
M64 = (1 << 64) - 1
NUMBERS = range(1024)
"""Every native number and more (x86_64 has ~460 calls; libseccomp's checks reach past)."""


def _number(name: str) -> int:
    nr = seccomp.syscall_number(name)
    assert nr is not None, name
    return nr


def _programs(spec: Mapping[str, Any]) -> list[Program]:
    return [Program(raw) for raw in seccomp.bpf_program(spec)]


def _values(conditions: list[list[Any]]) -> list[int]:
    """The values of one argument that the comparisons ``conditions`` tell apart."""
    out = {0, 1, M64, 0xFFFFFFFF, 1 << 32, 1 << 63}
    for _, op, a, b in conditions:
        if op == "masked_eq":
            out |= {b, b | (~a & M64), b & a}
            out |= {b ^ (1 << bit) for bit in range(64) if a >> bit & 1}
        else:
            out |= {(a - 1) & M64, a, (a + 1) & M64}
        out |= {v ^ (1 << 32) for v in list(out)}  # the upper half apart from the lower
    return sorted(out)


def _arguments(spec: Mapping[str, Any], name: str) -> Iterator[tuple[int, ...]]:
    """Argument vectors covering every class the spec's rules for ``name`` distinguish."""
    by_arg: dict[int, list[list[Any]]] = {}
    for fspec in spec["filters"]:
        for rule in fspec["rules"]:
            if rule[0] == name:
                for cond in rule[2]:
                    by_arg.setdefault(cond[0], []).append(cond)
    yield (0,) * 6
    if not by_arg:
        return
    indexes = sorted(by_arg)
    for combo in itertools.product(*(_values(by_arg[i]) for i in indexes)):
        args = [0] * 6
        for i, v in zip(indexes, combo, strict=True):
            args[i] = v
        yield tuple(args)
    rng = random.Random(name)
    for _ in range(32):
        yield tuple(rng.getrandbits(64) for _ in range(6))


def _points(spec: Mapping[str, Any]) -> Iterator[bytes]:
    names = {rule[0] for f in spec["filters"] for rule in f["rules"]}
    by_number = {seccomp.syscall_number(n): n for n in names}
    for nr in NUMBERS:
        name = by_number.get(nr)
        for args in (_arguments(spec, name) if name else [(0,) * 6, (M64,) * 6]):
            yield seccomp_data(nr, AUDIT_ARCH_X86_64, args)
        yield seccomp_data(nr | X32_SYSCALL_BIT, AUDIT_ARCH_X86_64)
        yield seccomp_data(nr, AUDIT_ARCH_I386)
    for nr in (-1, 0x7FFFFFFF, X32_SYSCALL_BIT - 1):
        yield seccomp_data(nr, AUDIT_ARCH_X86_64)
    yield seccomp_data(0, 0)


def assert_equivalent(spec: Mapping[str, Any]) -> Split | None:
    """The forked jail's filters give every point the spec's own verdict (None: the spec
    cannot be split, and a forked jail holds it whole)."""
    whole = _programs(spec)
    try:
        parts = split(spec)
    except Unsplittable:
        assert seccomp.forked_programs(spec) == seccomp.bpf_program(spec)
        return None
    forked = _programs(parts.zygote) + (_programs(parts.jail) if parts.jail else [])
    assert [p.insns for p in forked] == [Program(r).insns for r in seccomp.forked_programs(spec)]
    zygote = _programs(parts.zygote)
    for data in _points(spec):
        expected = verdict(whole, data)
        got = verdict(forked, data)
        assert got == expected, (data.hex(), hex(expected), hex(got))
    # and the zygote itself may make every call it needs, whatever the arguments it uses
    for name in parts.taken_back:
        nr = _number(name)
        assert verdict(zygote, seccomp_data(nr, AUDIT_ARCH_X86_64)) == SECCOMP_RET_ALLOW, name
    return parts


def _spec_of(path: Path) -> dict[str, Any]:
    policy = load_policy(path)
    return build_spec(policy.seccomp_choice, network=policy.network.mode != "none")


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_policy_splits_into_the_same_verdicts(path: Path) -> None:
    parts = assert_equivalent(_spec_of(path))
    assert parts is not None, f"{path.name} cannot be split: its jails would load it whole"
    # what the zygote needs and the policy refuses is taken back in each jail
    assert {"mount", "unshare", "setns", "sethostname"} <= set(parts.taken_back)
    assert parts.jail is not None


def test_the_split_makes_the_jails_filters_small() -> None:
    """The point of it: each jail loads a small program, not the allow-list."""
    spec = _spec_of(REPO / "policies" / "default.toml")
    parts = split(spec)
    assert parts.jail is not None
    whole = sum(len(p) for p in seccomp.bpf_program(spec))
    ours = sum(len(p) for p in seccomp.bpf_program(parts.jail))
    assert ours * 3 < whole, (ours, whole)


def test_the_needs_are_system_calls_of_this_architecture() -> None:
    assert all(seccomp.syscall_number(name) is not None for name in ZYGOTE_NEEDS)
    assert not ZYGOTE_NEEDS & set(GROUPS)


def test_a_zygote_need_the_split_cannot_rebuild_is_refused() -> None:
    """socket's list of families beside a kill default has no complement in a default-allow
    filter: the split says so rather than guess (the policy's jails load it whole)."""
    spec = _spec_of(REPO / "policies" / "default.toml")
    with pytest.raises(Unsplittable, match="socket"):
        split(spec, ZYGOTE_NEEDS | {"socket"})
    assert assert_equivalent(spec) is not None


def test_the_proof_can_fail() -> None:
    """Positive control: a jail filter that forgets one call is caught by the same check."""
    spec = _spec_of(REPO / "policies" / "default.toml")
    parts = split(spec)
    assert parts.jail is not None
    broken = {"filters": [
        {"default": "allow", "rules": [r for r in f["rules"] if r[0] != "mount"]}
        for f in parts.jail["filters"]
    ]}
    forked = _programs(parts.zygote) + _programs(broken)
    whole = _programs(spec)
    mount = _number("mount")
    data = seccomp_data(mount, AUDIT_ARCH_X86_64)
    assert verdict(whole, data) != SECCOMP_RET_ALLOW
    assert verdict(forked, data) == SECCOMP_RET_ALLOW


def test_the_interpreter_agrees_with_the_kernel_on_clone() -> None:
    """The interpreter reads the same program as the kernel: clone with a namespace flag is
    refused by the default policy, a plain fork is not (the hostile suites check the kernel)."""
    whole = _programs(_spec_of(REPO / "policies" / "default.toml"))
    clone = _number("clone")
    fork = seccomp_data(clone, AUDIT_ARCH_X86_64, (0x01200011,))
    newnet = seccomp_data(clone, AUDIT_ARCH_X86_64, (0x01200011 | 0x40000000,))
    assert verdict(whole, fork) == SECCOMP_RET_ALLOW
    assert verdict(whole, newnet) != SECCOMP_RET_ALLOW


ALL_NAMES = sorted({n for names in GROUPS.values() for n in names} | set(PROFILES["default"]))
CHOICES = st.builds(
    SeccompChoice,
    profile=st.sampled_from(sorted(PROFILES)),
    action=st.sampled_from(["kill", "errno"]),
    allow=st.lists(st.sampled_from([n for n in ALL_NAMES if n not in NEVER]), max_size=6)
    .map(tuple),
    deny=st.lists(
        st.sampled_from(["ioctl", "clone", "socket", "prctl", "fcntl", "getrandom", "mmap",
                         "wait4", "close_range", "personality", "@file-locks", "sysinfo"]),
        max_size=4,
    ).map(tuple),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choice=CHOICES, network=st.booleans())
def test_generated_policies_split_into_the_same_verdicts(
    choice: SeccompChoice, network: bool
) -> None:
    try:
        spec = build_spec(choice, network=network)
    except Exception:
        assume(False)
    assert_equivalent(spec)


NAMES = ["read", "clone", "ioctl", "fcntl", "prctl", "mount", "unshare", "socket", "wait4",
         "setns", "personality", "getrandom"]
ACTIONS = st.sampled_from(["allow", "kill", "errno", f"errno:{errno.EACCES}",
                           f"errno:{errno.ENOSYS}"])
CONDITIONS = st.lists(
    st.tuples(
        st.integers(0, 5),
        st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "masked_eq"]),
        st.sampled_from([0, 1, 2, 0x10, 0x7E020000, 0xFFFFFFFF, 1 << 40]),
        st.sampled_from([0, 1, 2, 0x10, 0x40000000, 1 << 40]),
    ).map(list),
    max_size=1,
)
RULES = st.lists(st.tuples(st.sampled_from(NAMES), ACTIONS, CONDITIONS).map(list), max_size=6)
FILTERS = st.lists(st.fixed_dictionaries({"default": ACTIONS, "rules": RULES}),
                   min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filters=FILTERS)
def test_generated_specs_split_into_the_same_verdicts_or_refuse(
    filters: list[dict[str, Any]],
) -> None:
    spec = {"filters": filters}
    try:
        seccomp.bpf_program(spec)
    except (OSError, SeccompSpecError, ValueError):
        assume(False)  # libseccomp refuses it (conflicting rules): no policy can hold it
    assert_equivalent(spec)
