"""Container mode, on the facts it reads: where a v1 daemon's job cgroups go (inside its own
cgroup, whatever the container runtime mounted), what counts as a masked /proc, and the
privilege checks on this host (the positive control of the unprivileged container's
refusal, which tests/integration/test_container.py runs for real under podman).
"""

from __future__ import annotations

from jaild.daemon.jails.cgroups import v1_bases
from jaild.daemon.selftest import masked_proc, privilege_checks

CGROUPS = """\
9:name=systemd:{p}
8:pids:{p}
4:memory:{p}
2:cpuacct:{p}
1:cpu:{p}
0::{p}
"""


def _mounts(root: str) -> str:
    """cgroup v1 hierarchies as /proc/self/mountinfo lists them, each mounted from ``root``."""
    lines = ["22 27 0:21 / /proc rw,relatime - proc proc rw",
             "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755"]
    for i, c in enumerate(("cpu", "cpuacct", "memory", "pids")):
        lines.append(f"{40 + i} 31 0:{30 + i} {root} /sys/fs/cgroup/{c} rw,relatime - "
                     f"cgroup cgroup rw,{c}")
    return "\n".join(lines) + "\n"


POD = "/libpod_parent/libpod-0123"


def test_on_a_host_the_subtree_goes_in_the_daemons_own_cgroup() -> None:
    bases = dict(v1_bases(mountinfo=_mounts("/"), cgroups=CGROUPS.format(p="/system.slice/j")))
    assert bases["memory"] == "/sys/fs/cgroup/memory/system.slice/j"
    assert bases["pids"] == "/sys/fs/cgroup/pids/system.slice/j"
    root = dict(v1_bases(mountinfo=_mounts("/"), cgroups=CGROUPS.format(p="/")))
    assert root["memory"] == "/sys/fs/cgroup/memory"  # a daemon in the root: as before


def test_a_runtime_that_mounts_the_containers_cgroup_gives_the_mount_point() -> None:
    """podman/runc and containerd bind-mount just the container's cgroup (the mount's root
    is its path): the mount point is the container's cgroup, in the host's cgroup namespace
    and in a private one alike."""
    host_ns = dict(v1_bases(mountinfo=_mounts(POD), cgroups=CGROUPS.format(p=POD)))
    private_ns = dict(v1_bases(mountinfo=_mounts("/"), cgroups=CGROUPS.format(p="/")))
    assert host_ns["memory"] == private_ns["memory"] == "/sys/fs/cgroup/memory"


def test_the_hosts_whole_hierarchy_in_a_container_still_nests_in_the_container() -> None:
    """A container given the host's /sys/fs/cgroup (``-v /sys/fs/cgroup:/sys/fs/cgroup``)
    sees every hierarchy from its root: the subtree must still go inside the container's
    cgroup, so a pod's limit caps the jails and deleting it takes them along."""
    bases = dict(v1_bases(mountinfo=_mounts("/"), cgroups=CGROUPS.format(p=POD)))
    assert bases["memory"] == "/sys/fs/cgroup/memory" + POD
    assert bases["pids"] == "/sys/fs/cgroup/pids" + POD


def test_a_path_outside_the_namespace_never_escapes_the_mount() -> None:
    bases = dict(v1_bases(mountinfo=_mounts("/"), cgroups=CGROUPS.format(p="/../../other")))
    assert bases["memory"] == "/sys/fs/cgroup/memory"
    elsewhere = dict(v1_bases(mountinfo=_mounts(POD), cgroups=CGROUPS.format(p="/other")))
    assert elsewhere["memory"] == "/sys/fs/cgroup/memory"


def test_an_unmounted_hierarchy_keeps_its_default_path() -> None:
    mounts = "\n".join(line for line in _mounts("/").splitlines() if "cpuacct" not in line)
    bases = dict(v1_bases(mountinfo=mounts, cgroups=CGROUPS.format(p="/x")))
    assert bases["cpuacct"] == "/sys/fs/cgroup/cpuacct"
    assert bases["memory"] == "/sys/fs/cgroup/memory/x"


MASKED = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
600 22 0:21 /bus /proc/bus ro,nosuid - proc proc rw
601 22 0:21 /sys /proc/sys ro,nosuid - proc proc rw
602 22 0:50 /null /proc/keys rw,nosuid - tmpfs tmpfs rw
603 22 0:51 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw
"""


def test_a_containers_masks_over_proc_are_named() -> None:
    assert masked_proc(MASKED) == ["/proc/bus", "/proc/sys", "/proc/keys"]
    assert masked_proc(MASKED.splitlines()[0]) == []


def test_this_host_gives_the_daemon_every_privilege_a_jail_needs() -> None:
    """The positive control of the container refusal: the same checks pass here (root,
    no masks, a writable cgroupfs, every namespace and a fresh /proc made for real)."""
    checks = {c.name: c for c in privilege_checks()}
    assert sorted(checks) == ["/proc unmasked", "capabilities", "cgroupfs writable", "namespaces"]
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]
