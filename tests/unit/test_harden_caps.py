"""The runtime's capability checks (:mod:`jaild.runtime.harden`), on this process's real
capabilities: root here holds what the kernel says it holds (the positive control), a child
that empties its bounding set and leaves uid 0 holds none, and one that keeps a capability is
named."""

from __future__ import annotations

import os

import prctl
import pytest

from jaild.runtime import harden

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root's capabilities")


def _in_child(body: str) -> str:
    """Run ``body`` (a statement setting ``out``) in a forked child; its ``out``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            scope: dict[str, object] = {"harden": harden, "os": os, "prctl": prctl}
            exec(body, scope)
            os.write(w, repr(scope["out"]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def _status_set(line: str) -> set[int]:
    """The capability numbers of one of /proc/self/status's ``Cap*`` masks."""
    with open("/proc/self/status") as f:
        mask = next(int(x.split()[1], 16) for x in f if x.startswith(line + ":"))
    return {cap for cap in prctl.ALL_CAPS if mask >> cap & 1}


def test_root_holds_what_the_kernel_says_it_holds() -> None:
    """The positive control: the capabilities root has here (nearly all: a host may keep
    some from it) are found, set by set, as /proc/self/status lists them."""
    names = dict(zip(prctl.ALL_CAPS, prctl.ALL_CAP_NAMES, strict=True))
    left = harden.capabilities_left()
    bounding = _status_set("CapBnd")
    assert bounding and {x for x in left if x.startswith("bounding:")} == {
        f"bounding:{names[c]}" for c in bounding}
    held = _status_set("CapEff") | _status_set("CapPrm")
    assert held and {x for x in left if x.startswith("effective/permitted:")} == {
        f"effective/permitted:{names[c]}" for c in held}
    assert "bounding:sys_admin" in left and "effective/permitted:sys_admin" in left


def test_an_empty_bounding_set_and_a_uid_other_than_0_hold_none() -> None:
    out = _in_child("harden.empty_bounding_set(); os.setresgid(65534, 65534, 65534); "
                    "os.setresuid(65534, 65534, 65534); out = harden.capabilities_left()")
    assert out == "[]"


def test_what_is_left_is_named_set_by_set() -> None:
    # the bounding set emptied but uid 0 kept: the effective and permitted sets still hold all
    out = _in_child("harden.empty_bounding_set(); out = harden.capabilities_left()")
    assert "bounding:" not in out and "'effective/permitted:sys_admin'" in out
    # one capability kept in the bounding set, the rest dropped by number
    out = _in_child("[prctl.capbset_drop(c) for c in prctl.ALL_CAPS if c != prctl.CAP_KILL]; "
                    "os.setresuid(65534, 65534, 65534); out = harden.capabilities_left()")
    assert out == "['bounding:kill']"
