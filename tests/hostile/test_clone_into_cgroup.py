"""A zygote forks its jails straight into their jobs' cgroups (``clone3(CLONE_INTO_CGROUP)``,
:mod:`jaild.runtime.clone3`), on the real kernel's cgroup v2 hierarchy (this host mounts one
beside its v1 controllers; the Debian 12 guest's is the only one).

Two claims. The child is a whole process, as a ``fork`` child is: glibc's cached thread id
is its own (a thread, a ``fork`` and ``multiprocessing``'s locks use it), its robust-futex
list is registered, and it is born in the cgroup -- never in its parent's. And the layout
the daemon makes (:meth:`jaild.daemon.jails.cgroups.Cgroups.create_home`) is what limits a
zygote: as its host uid, a process can fork into a leaf of its own home whose
``cgroup.procs`` is its, and nowhere else -- not a leaf of its home that is not its own
(another job's), and not its own leaf outside its home (the common ancestor is then not its).
Each refusal has its positive control: the same fork as root, or with the ancestor given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import guard

UID = 3_999_123
"""The zygote's host uid in these tests: no process's, no file's."""

PROBE = r"""
import ctypes, json, os, sys, threading
from jaild.runtime import clone3

targets, uid, settid = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
with open(os.path.join(sys.argv[4], "cgroup.procs"), "w") as f:  # the zygote's own cgroup
    f.write(str(os.getpid()))
cloner = clone3.prepare()
assert not isinstance(cloner, str), cloner
if not settid:  # the control: glibc's thread id left as the parent's
    cloner._args[0] &= ~clone3.CLONE_CHILD_SETTID
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_void_p
offset = (ctypes.c_uint32 * 3).in_dll(libc, "_thread_db_pthread_tid")[2]
if uid:
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
out = {}
for target in targets:
    fd = os.open(target, os.O_PATH | os.O_DIRECTORY)
    r, w = os.pipe()
    try:
        pid = cloner.fork(fd)
    except OSError as exc:
        out[target] = {"errno": exc.errno}
        continue
    finally:
        os.close(fd)
    if pid == 0:
        try:
            os.close(r)
            seen = {"cgroup": [ln for ln in open("/proc/self/cgroup").read().splitlines()
                               if ln.startswith("0::")],  # v2's line (a hybrid host has more)
                    "pid": os.getpid(), "glibc_tid": ctypes.c_int.from_address(
                        libc.pthread_self() + offset).value,
                    "native_id": threading.get_native_id()}
            t = threading.Thread(target=lambda: seen.update(thread=threading.get_native_id()))
            t.start()
            t.join()
            kid = os.fork()
            if kid == 0:
                os._exit(7)
            seen["fork"] = os.waitpid(kid, 0)[1] >> 8
            head, size = ctypes.c_void_p(), ctypes.c_size_t()
            libc.syscall(274, 0, ctypes.byref(head), ctypes.byref(size))  # get_robust_list
            seen["robust"] = bool(head.value)
            os.write(w, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out[target] = json.loads(data)
print(json.dumps(out))
"""


def _cgroup2_mount() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, mount, kind, *_ = line.split()
        if kind == "cgroup2":
            return Path(mount)
    raise AssertionError("no cgroup v2 hierarchy is mounted here (these machines have one)")


@pytest.fixture
def tree() -> Iterator[Path]:
    """``root/home/{zygote, job-a/jail, job-b/jail}`` and ``root/other/jail``: the zygote's
    home, its own cgroup, a leaf of its own, one not its own, and its own leaf elsewhere."""
    root = _cgroup2_mount() / f"jaild-test-clone3-{os.getpid()}"
    dirs = ["", "home", "home/zygote", "home/job-a", "home/job-a/jail", "home/job-b",
            "home/job-b/jail", "other", "other/jail"]
    for d in dirs:
        (root / d).mkdir()
    for d in ("home", "home/job-a/jail", "other/jail"):
        os.chown(root / d / "cgroup.procs", UID, -1)
    try:
        yield root
    finally:
        for d in reversed(dirs):
            (root / d).rmdir()


def _probe(tree: Path, targets: list[str], *, uid: int = UID, settid: bool = True
           ) -> dict[str, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([str(tree / t) for t in targets]), str(uid),
         "1" if settid else "0", str(tree / "home/zygote")],
        capture_output=True, text=True, timeout=guard(60), check=False,
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, dict[str, object]] = json.loads(done.stdout)
    return {str(Path(k).relative_to(tree)): v for k, v in out.items()}


def test_a_child_is_born_in_its_cgroup_a_whole_process(tree: Path) -> None:
    seen = _probe(tree, ["home/job-a/jail"])["home/job-a/jail"]
    mount = _cgroup2_mount()
    assert seen["cgroup"] == [f"0::/{(tree / 'home/job-a/jail').relative_to(mount)}"], seen
    assert seen["glibc_tid"] == seen["pid"] == seen["native_id"], seen
    assert seen["thread"] not in (None, seen["pid"]), seen
    assert seen["fork"] == 7 and seen["robust"] is True, seen


def test_without_child_settid_glibc_keeps_the_parents_thread_id(tree: Path) -> None:
    """The control for the claim above: the kernel's write is what makes glibc's id right."""
    seen = _probe(tree, ["home/job-a/jail"], settid=False)["home/job-a/jail"]
    assert seen["glibc_tid"] != seen["pid"], seen


def test_a_zygote_forks_into_its_own_leaves_alone(tree: Path) -> None:
    seen = _probe(tree, ["home/job-a/jail", "home/job-b/jail", "other/jail"])
    assert "cgroup" in seen["home/job-a/jail"], seen
    # not its leaf: EACCES; its leaf, but the common ancestor (root) not its: EACCES
    assert seen["home/job-b/jail"] == {"errno": 13}, seen
    assert seen["other/jail"] == {"errno": 13}, seen


def test_the_refusals_controls(tree: Path) -> None:
    """The same forks succeed as root, and into ``other`` once the ancestor is given too:
    the refusals above are the kernel's permission rules, not broken targets."""
    as_root = _probe(tree, ["home/job-b/jail", "other/jail"], uid=0)
    assert all("cgroup" in v for v in as_root.values()), as_root
    os.chown(tree / "cgroup.procs", UID, -1)
    try:
        given = _probe(tree, ["other/jail"])
    finally:
        os.chown(tree / "cgroup.procs", 0, -1)
    assert "cgroup" in given["other/jail"], given
