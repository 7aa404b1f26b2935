"""Which Kubernetes pod a connecting client belongs to (issue 26, pods as tenants).

Theory of operation
-------------------
A client's identity on the socket is its ``SO_PEERCRED``: a pid and a uid. In a cluster the
uid says little (every pod may run as uid 1000); the *pod* is the tenant. A process's pod is
written in its cgroup, by the kubelet and the container runtime, which the process cannot
change (moving a process between cgroups takes privilege over both). So:

1. **Who** (:func:`peer_cgroup`): read the connecting process's ``/proc/<pid>/cgroup`` such
   that a recycled pid cannot lend another process's cgroup to the connection. We pin a
   process with a pidfd -- ``SO_PEERPIDFD`` where the kernel has it (6.5+: the very process
   that connected, even if it has since exited), else ``pidfd_open(pid)`` (whatever has the
   pid now) --, check that the process still holds the client end of *this* connection (the
   peer socket's inode, asked of the kernel with ``NETLINK_SOCK_DIAG``/``unix_diag``, among
   its ``/proc/<pid>/fd``: a new process that inherited the pid number does not hold it),
   read the file, and check the pidfd's process is still there (not reaped): while it is not
   reaped its pid number is its own, so the file read was its file. A refusal is a
   :class:`PeerUnverified` saying why.
2. **Which pod** (:func:`pod_of_cgroup`, pure): the kubelet's cgroup names, for both cgroup
   drivers (``/kubepods/burstable/pod<uid>/<container>`` and
   ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/
   cri-containerd-<container>.scope``), wherever the kubelet's root is mounted. Only a
   well-formed pod uid and container id make a :class:`PodRef`; anything else is ``None``.
   :func:`in_kubepods` tells a process in *some* kubelet cgroup that did not parse from a
   process in none: the first should be refused, not taken for a host process.
3. **What pod** (:class:`PodDirectory`): the uid is mapped to the pod's namespace, name and
   service account by a LIST then WATCH of this node's pods on the Kubernetes API, kept in
   memory by a thread. A pod that is deleted -- or is terminating (``deletionTimestamp``
   set), or has finished (phase ``Succeeded``/``Failed``) -- counts as deleted: its
   processes may linger through the grace period, and no new work is taken from them.
   Deletion is final (a uid is never reused). A pod not yet seen may be waited for
   (:meth:`PodDirectory.get` with ``wait_s``): the pod object exists before its containers
   start, but the watch may lag. The pod's spec also says how many jail slots it requests
   (:func:`pod_slots`: an extended resource a device plugin advertises, ``access.slot_resource``).

The cost of :func:`peer_cgroup`, measured on this project's 2-core test host (kernel 6.18,
under load from other tests): 35-60 us a call, the same with SO_PEERPIDFD or ``pidfd_open``,
for a client holding 4 fds -- a unix_diag round trip 10-17 us, reading /proc/<pid>/cgroup
~13 us, the fd scan ~4 us per fd the client holds (a readlink each: ~400 us for a client
with 100 fds). :func:`pod_of_cgroup` adds ~5 us for a host process, ~17 us for a pod's. A
client in a network namespace other than the daemon's -- every pod's -- adds a thread that
enters it for the unix_diag query: :func:`peer_inode` took 250-1,600 us a call for such a
client, 30-45 us for one in the daemon's namespace (2026-11-29, the same host, loaded by
other work), once per connection.

Kernel facts this relies on: ``SO_PEERPIDFD`` (6.5) gives a pidfd even for a peer already
reaped from 6.16 on (pidfs; it then signals ESRCH), and fails with EINVAL for one on 6.5-6.15;
before 6.5 it is ENOPROTOOPT and ``pidfd_open`` (5.3) is used. The server's end of a Unix
connection belongs to the client's network namespace, and unix_diag answers only about
sockets of the asker's: the query is made from the connection's own namespace (``SIOCGSKNS``,
4.9), since every pod has one of its own (found with the image under podman, each agent in a
network namespace of its own: ``tests/integration/test_pods_container.py``). A cgroup's name
cannot hold a newline (mkdir says EINVAL), so a line of /proc/<pid>/cgroup cannot be forged by
a name; a hierarchy listed twice is refused anyway. "Holds the connection" means holds the client
socket: a process that inherited it or was handed it holds it too; the credentials stay the
connector's (``SO_PEERCRED``), and the check only rules out a pid number taken over by a
process without the socket.

Static pods (whose cgroup names carry the kubelet's 32-hex hash, not the API's uid) are not
recognised.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import http.client
import json
import logging
import os
import random
import re
import signal
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from jaild.daemon.jails.netns import made_in
from jaild.errors import KubeAPIError, KubeAPIGone, PeerUnverified

log = logging.getLogger("jaild")

# --- which pod a cgroup path names (pure) ------------------------------------------------

_HEX = "[0-9a-f]"
_UID = "{0}{{8}}{1}{0}{{4}}{1}{0}{{4}}{1}{0}{{4}}{1}{0}{{12}}"
_UID_SYSTEMD = _UID.format(_HEX, "_")  # systemd's unit names have no dashes to spare
_UID = _UID.format(_HEX, "-")
_CID = f"{_HEX}{{64}}"
_RUNTIME = "(?:cri-containerd|crio|docker)"
_QOS = "(?:burstable|besteffort)"

# cgroupfs driver: /kubepods[/burstable|/besteffort]/pod<uid>/<cid>
_FS_POD = re.compile(f"pod(?P<uid>{_UID})", re.ASCII)
_FS_CONTAINER = re.compile(f"(?:crio-)?(?P<cid>{_CID})", re.ASCII)
# systemd driver: [<p>-]kubepods.slice/[<p>-]kubepods-<qos>.slice/
#   [<p>-]kubepods[-<qos>]-pod<uid_>.slice/<runtime>-<cid>.scope (<p>: a cgroup root such as
#   kind's "kubelet"); or, where the runtime made a systemd path without systemd (containerd
#   under /system.slice/containerd.service), one component "<pod slice>:<runtime>:<cid>".
_SD_ROOT = re.compile("(?P<prefix>(?:[a-z0-9]+-)*)kubepods\\.slice", re.ASCII)
_SD_CONTAINER = re.compile(f"{_RUNTIME}-(?P<cid>{_CID})\\.scope", re.ASCII)
_SD_FLAT = re.compile(
    f"(?:[a-z0-9]+-)*kubepods(?:-(?P<qos>{_QOS}))?-pod(?P<uid>{_UID_SYSTEMD})\\.slice"
    f":{_RUNTIME}:(?P<cid>{_CID})", re.ASCII,
)
_UID_FORM = re.compile(_UID, re.ASCII)
_HIERARCHY = re.compile("[0-9]+", re.ASCII)
_MAX_CGROUP_TEXT = 1 << 16
_PLACING_CONTROLLERS = {"memory", "pids", "name=systemd"}

QoS = Literal["guaranteed", "burstable", "besteffort"]


@dataclass(frozen=True)
class PodRef:
    """A pod and container named by a process's cgroup."""

    pod_uid: str  # the API's metadata.uid: 8-4-4-4-12 lowercase hex
    container_id: str  # 64 lowercase hex (the runtime's id, without its prefix)
    qos: QoS
    driver: Literal["cgroupfs", "systemd"]


def _qos(name: str | None) -> QoS:
    return "burstable" if name == "burstable" else "besteffort" if name == "besteffort" \
        else "guaranteed"


def _rest_ok(rest: list[str]) -> bool:
    """Sub-cgroups below the container are ignored -- but a real path has no empty, ``.``
    or ``..`` components."""
    return all(c not in ("", ".", "..") for c in rest)


def _cgroupfs(parts: list[str]) -> PodRef | None:
    qos = None
    if parts and parts[0] in ("burstable", "besteffort"):
        qos, parts = parts[0], parts[1:]
    if len(parts) < 2 or not _rest_ok(parts[2:]):
        return None
    pod, container = _FS_POD.fullmatch(parts[0]), _FS_CONTAINER.fullmatch(parts[1])
    if pod is None or container is None:
        return None
    return PodRef(pod["uid"], container["cid"], _qos(qos), "cgroupfs")


def _systemd(prefix: str, parts: list[str]) -> PodRef | None:
    qos = None
    if parts and (m := re.fullmatch(f"{re.escape(prefix)}kubepods-({_QOS})\\.slice", parts[0])):
        qos, parts = m[1], parts[1:]
    if len(parts) < 2 or not _rest_ok(parts[2:]):
        return None
    slice_name = f"{prefix}kubepods-{qos}-pod" if qos else f"{prefix}kubepods-pod"
    pod = re.fullmatch(f"{re.escape(slice_name)}(?P<uid>{_UID_SYSTEMD})\\.slice", parts[0],
                       re.ASCII)
    container = _SD_CONTAINER.fullmatch(parts[1])
    if pod is None or container is None:
        return None
    return PodRef(pod["uid"].replace("_", "-"), container["cid"], _qos(qos), "systemd")


DEFAULT_ROOTS = ("/",)
"""Where the kubelet's hierarchy starts by default (its ``--cgroup-root``): ``/kubepods``,
``/kubepods.slice``."""


def normalize_root(root: str) -> str:
    """A kubelet cgroup root as :func:`pod_of_path` compares it: absolute, no trailing
    slash (but ``/``), no empty, ``.`` or ``..`` component. Raises ValueError."""
    if not root.startswith("/"):
        raise ValueError(f"{root!r} is not an absolute cgroup path")
    parts = [p for p in root.split("/")[1:] if p != ""]
    if any(p in (".", "..") for p in parts) or "\n" in root:
        raise ValueError(f"{root!r} has a '.' or '..' component")
    return "/" + "/".join(parts)


def pod_of_path(path: str, roots: tuple[str, ...] = DEFAULT_ROOTS) -> PodRef | None:
    """The pod and container a cgroup path names, or None. The first component that starts
    a kubelet hierarchy (``kubepods``, ``kubepods.slice``, ``<root>-kubepods.slice``, or the
    flat ``...-pod<uid>.slice:<runtime>:<id>``) decides: it must sit exactly at one of
    ``roots`` (normalized, :func:`normalize_root`: where the kubelet's hierarchy starts, a
    directory only root can write), and what follows it must be the kubelet's names
    exactly, down to the container (what is below that is ignored). A kubelet's names
    anywhere else -- below a subtree a process made itself (a systemd-delegated
    ``user@UID.service``, a rootless container's) -- name no pod."""
    if not path.startswith("/"):
        return None
    parts = path.split("/")[1:]
    for i, part in enumerate(parts):
        cgroupfs = part == "kubepods"
        root = None if cgroupfs else _SD_ROOT.fullmatch(part)
        flat = None if cgroupfs or root else _SD_FLAT.fullmatch(part)
        if not (cgroupfs or root or flat):
            continue
        if "/" + "/".join(parts[:i]) not in roots:
            return None  # a kubelet's name outside the kubelet's root
        if cgroupfs:
            return _cgroupfs(parts[i + 1:])
        if root:
            return _systemd(root["prefix"], parts[i + 1:])
        assert flat is not None
        if not _rest_ok(parts[i + 1:]):
            return None
        return PodRef(flat["uid"].replace("_", "-"), flat["cid"], _qos(flat["qos"]),
                      "systemd")
    return None


def pod_of_cgroup(proc_cgroup: str, roots: tuple[str, ...] = DEFAULT_ROOTS) -> PodRef | None:
    """The pod a process is in, from the text of its ``/proc/<pid>/cgroup``; None if it is in
    none (or the text is malformed: a line that is not ``N:controllers:path``, a hierarchy
    twice, lines naming different pods or containers).

    The lines read: cgroup v1's memory, pids and name=systemd hierarchies (where the kubelet
    and the runtime place every container), and cgroup v2's ``0::`` line. Lines that name no
    pod are ignored (a hierarchy the runtime did not use); those that name one must agree."""
    if len(proc_cgroup) > _MAX_CGROUP_TEXT:
        return None
    found: set[PodRef] = set()
    hierarchies: set[str] = set()
    for line in proc_cgroup.split("\n"):
        if not line:
            continue
        fields = line.split(":", 2)
        if len(fields) != 3 or not _HIERARCHY.fullmatch(fields[0]):
            return None
        hierarchy, controllers, path = fields
        if hierarchy in hierarchies:
            return None
        hierarchies.add(hierarchy)
        if (hierarchy == "0") != (controllers == ""):
            return None  # only cgroup v2's line is hierarchy 0, and it alone names nothing
        if "kubepods" not in path:
            continue  # the common case, a host process: no need to look closer
        if hierarchy == "0" or _PLACING_CONTROLLERS & set(controllers.split(",")):
            ref = pod_of_path(path, roots)
            if ref is not None:
                found.add(ref)
    return found.pop() if len(found) == 1 else None


def in_kubepods(proc_cgroup: str) -> bool:
    """Does the text name a kubelet cgroup at all (parsed or not)? A process for which this
    holds but :func:`pod_of_cgroup` gives None is in a pod we cannot name: refuse it."""
    return "kubepods" in proc_cgroup


# --- where the kubelet's hierarchy starts (checked at the daemon's start) ----------------

CGROUP_MOUNT = "/sys/fs/cgroup"
_KUBELET_TOP = re.compile("kubepods|(?:[a-z0-9]+-)*kubepods\\.slice", re.ASCII)


def cgroup_bases(mount: str = CGROUP_MOUNT) -> list[str]:
    """The directories a cgroup path is read below: cgroup v2's mount, or v1's hierarchies
    that place containers (memory, pids, name=systemd) that are mounted."""
    if os.path.exists(os.path.join(mount, "cgroup.controllers")):
        return [mount]
    return [os.path.join(mount, h) for h in ("memory", "pids", "systemd")
            if os.path.isdir(os.path.join(mount, h))]


def root_problem(directory: str) -> str | None:
    """Why ``directory`` (a kubelet hierarchy's top, on the cgroup file system) cannot
    anchor pods: a process that could write it could make a pod's names there. None: it is
    owned by root and nobody else may write it (or it does not exist)."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot stat {directory}: {e.strerror}"
    if st.st_uid != 0:
        return f"{directory} is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        return f"{directory} is writable by its group or others (mode {st.st_mode & 0o777:o})"
    return None


def _kubelet_tops(directory: str) -> tuple[list[str], list[str]]:
    """``directory``'s subdirectories: (those that are a kubelet hierarchy's top --
    ``kubepods``, ``kubepods.slice``, ``<p>-kubepods.slice`` --, the others); none if it
    cannot be read."""
    try:
        names = [e.name for e in os.scandir(directory) if e.is_dir()]
    except OSError:
        return [], []
    tops = [n for n in names if _KUBELET_TOP.fullmatch(n)]
    return tops, [n for n in names if n not in tops]


def detect_roots(bases: list[str]) -> tuple[list[str], list[str]]:
    """The kubelet cgroup roots found below ``bases`` (a kubelet hierarchy's top at the top
    or up to two levels down), and why each one refused was (:func:`root_problem`)."""
    found: set[str] = set()
    refused: list[str] = []
    for base in bases:
        frontier = [("/", base)]
        for _depth in range(3):
            deeper = []
            for root, directory in frontier:
                tops, others = _kubelet_tops(directory)
                for name in tops:
                    why = root_problem(os.path.join(directory, name))
                    if why is None:
                        found.add(root)
                    else:
                        refused.append(why)
                deeper += [(f"{root.rstrip('/')}/{n}", os.path.join(directory, n))
                           for n in others]
            frontier = deeper
    return sorted(found), refused


def check_roots(roots: tuple[str, ...], bases: list[str]) -> str | None:
    """Why one of the configured ``roots`` cannot anchor pods (a kubelet hierarchy's top
    below it that another user could write), or None."""
    for root in roots:
        for base in bases:
            directory = os.path.join(base, root.lstrip("/"))
            for name in _kubelet_tops(directory)[0]:
                why = root_problem(os.path.join(directory, name))
                if why is not None:
                    return f"{root}: {why}"
    return None


PROC_CGROUP_INIT_INO = 0xEFFFFFFB
"""The inode of the initial cgroup namespace (the kernel's ``include/linux/proc_ns.h``)."""


def cgroup_namespace_problem(self_ns_ino: int | None = None,
                             self_cgroup: str | None = None) -> str | None:
    """Why this process's cgroup namespace hides the paths pods are told apart by, or None.
    In the initial namespace every path is the host's. In another (a container's own), a
    process outside it reads as ``/../../kubepods/...``, and the daemon sits at its root
    (``/``): pods' paths are not the kubelet's names. A nested namespace the daemon is
    placed *in* (a node that is itself a container, as kind's) reads its own path below the
    kubelet's, and is let be. The arguments stand for ``/proc/self/ns/cgroup``'s inode and
    ``/proc/self/cgroup``'s text (tests)."""
    try:
        ino = self_ns_ino if self_ns_ino is not None else os.stat("/proc/self/ns/cgroup").st_ino
        if self_cgroup is None:
            with open("/proc/self/cgroup") as f:
                self_cgroup = f.read()
        text = self_cgroup
    except OSError as e:
        return f"cannot read this process's cgroup namespace: {e.strerror}"
    if ino == PROC_CGROUP_INIT_INO:
        return None
    paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2
             and (line.startswith("0::") or _PLACING_CONTROLLERS
                  & set(line.split(":", 2)[1].split(",")))]
    if any(p.startswith("/..") for p in paths) or (paths and all(p == "/" for p in paths)):
        return ("the daemon runs at the root of a cgroup namespace of its own, where other "
                "processes' cgroup paths are not the kubelet's names: run it in the host's "
                "cgroup namespace (podman/docker --cgroupns=host; a pod shares the node's "
                "unless its runtime gives it one)")
    return None


# --- the peer's cgroup, read safely ------------------------------------------------------

SO_PEERPIDFD = 77  # linux/asm-generic/socket.h, kernel 6.5+
USE_SO_PEERPIDFD = True
"""Ask for the peer's pidfd with SO_PEERPIDFD where the kernel has it. False forces
``pidfd_open(pid)``, as on kernels before 6.5 (Debian 12's 6.1); tests use it."""

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_UDIAG_SHOW_PEER = 0x4
_UNIX_DIAG_PEER = 2
_NLMSGHDR = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")  # family, type, state, pad, ino, cookie
_NLATTR = struct.Struct("=HH")


def _exited(pid: int) -> PeerUnverified:
    return PeerUnverified(f"the connecting process (pid {pid}) has exited")


def _pidfd(conn: socket.socket, pid: int, peerpidfd: bool) -> int:
    if peerpidfd:
        try:
            fd: int = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            return fd
        except OSError as e:
            # 6.5-6.15 refuse a pidfd for a reaped peer (EINVAL); 6.16+ give one
            if e.errno in (errno.ESRCH, errno.EINVAL):
                raise _exited(pid) from None
            if e.errno != errno.ENOPROTOOPT:
                raise PeerUnverified(f"SO_PEERPIDFD failed: {e}") from None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise _exited(pid) from None
    except OSError as e:
        raise PeerUnverified(f"pidfd_open({pid}) failed: {e}") from None


def _alive(pidfd: int) -> bool:
    """Is the pidfd's process not yet reaped (a zombie is; its pid is still its own)?"""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


SIOCGSKNS = 0x894C  # linux/sockios.h (4.9+): a descriptor of a socket's network namespace


def _diag_socket(conn: socket.socket) -> socket.socket:
    """A NETLINK_SOCK_DIAG socket in the network namespace ``conn`` belongs to.

    The server's end of a Unix connection is made in the *client's* network namespace
    (the kernel's ``unix_stream_connect``), and unix_diag finds only the sockets of the
    asking socket's namespace: a client in a pod has the pod's namespace, never the
    daemon's (a pod's network namespace is its own, and the daemon's is its pod's or the
    node's), so it is looked up from a socket made there
    (:func:`jaild.daemon.jails.netns.made_in`)."""
    nsfd = fcntl.ioctl(conn.fileno(), SIOCGSKNS)
    try:
        if os.fstat(nsfd).st_ino == os.stat("/proc/thread-self/ns/net").st_ino:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
        return made_in(nsfd, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                                   _NETLINK_SOCK_DIAG))
    finally:
        os.close(nsfd)


def peer_inode(conn: socket.socket) -> int:
    """The inode of the socket at the other end of ``conn`` (a connected AF_UNIX socket),
    from the kernel's unix_diag, asked in the namespace ``conn`` belongs to
    (:func:`_diag_socket`); 0 if that end has been closed by every holder."""
    ino = os.fstat(conn.fileno()).st_ino
    req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino, _UDIAG_SHOW_PEER,
                              0xFFFFFFFF, 0xFFFFFFFF)
    hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    try:
        with _diag_socket(conn) as nl:
            nl.send(hdr + req)
            data = nl.recv(8192)
    except OSError as e:
        raise PeerUnverified(f"cannot ask the kernel for the peer socket (unix_diag): {e}") \
            from None
    length, kind, _flags, _seq, _port = _NLMSGHDR.unpack_from(data)
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, _NLMSGHDR.size)[0]
        raise PeerUnverified(f"unix_diag refused the lookup: {os.strerror(code)}")
    if kind != _SOCK_DIAG_BY_FAMILY or length > len(data):
        raise PeerUnverified(f"unix_diag answered with message type {kind}")
    if _UNIX_DIAG_MSG.unpack_from(data, _NLMSGHDR.size)[4] != ino:
        raise PeerUnverified("unix_diag answered about another socket")
    at = _NLMSGHDR.size + _UNIX_DIAG_MSG.size
    while at + _NLATTR.size <= length:
        alen, atype = _NLATTR.unpack_from(data, at)
        if alen < _NLATTR.size:
            break
        if atype == _UNIX_DIAG_PEER and alen >= _NLATTR.size + 4:
            peer: int = struct.unpack_from("=I", data, at + _NLATTR.size)[0]
            return peer
        at += (alen + 3) & ~3
    return 0


MAX_PEER_FDS = 4096
"""The most descriptors of a connecting process looked through for its end of the
connection (a readlink each, ~4 us): past it the process is refused, not waited for -- a
client holding a million descriptors must not hold the daemon's event loop for seconds."""


def _holds(pid: int, link: str, most: int | None = None) -> bool:
    limit = MAX_PEER_FDS if most is None else most
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for n, fd in enumerate(fds):
                if n >= limit:
                    raise PeerUnverified(
                        f"the connecting process (pid {pid}) holds more than {limit} "
                        "descriptors; its end of the connection is not looked for past them")
                with contextlib.suppress(OSError):  # closed as we looked
                    if os.readlink(fd.path) == link:
                        return True
    except FileNotFoundError:
        return False
    except PeerUnverified:
        raise
    except OSError as e:
        raise PeerUnverified(f"cannot read /proc/{pid}/fd: {e}") from None
    return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def peer_cgroup(conn: socket.socket, pid: int, *, peerpidfd: bool | None = None) -> str:
    """The text of ``/proc/<pid>/cgroup`` of the process that connected ``conn`` (``pid``:
    its SO_PEERCRED pid), read so that a recycled pid cannot lend it another process's; else
    :class:`PeerUnverified`. ``peerpidfd``: use SO_PEERPIDFD (default
    :data:`USE_SO_PEERPIDFD`; it is used only where the kernel has it)."""
    if pid <= 0:
        raise PeerUnverified("the connecting process is not in the daemon's pid namespace")
    pidfd = _pidfd(conn, pid, USE_SO_PEERPIDFD if peerpidfd is None else peerpidfd)
    try:
        if not _alive(pidfd):
            raise _exited(pid)
        peer = peer_inode(conn)
        if peer == 0 or not _holds(pid, f"socket:[{peer}]"):
            if not _alive(pidfd) or _zombie(pid):
                raise _exited(pid)
            why = "its client end is closed" if peer == 0 else "a recycled pid?"
            raise PeerUnverified(f"pid {pid} does not hold this connection ({why})")
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                text = f.read(_MAX_CGROUP_TEXT + 1)
        except FileNotFoundError:
            raise _exited(pid) from None
        except OSError as e:
            raise PeerUnverified(f"cannot read /proc/{pid}/cgroup: {e}") from None
        if not _alive(pidfd):
            raise _exited(pid)
        return text
    finally:
        os.close(pidfd)


# --- the node's pods, from the Kubernetes API --------------------------------------------

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_FINISHED_PHASES = ("Succeeded", "Failed")
_MAX_LIST_BYTES = 64 << 20
_MAX_EVENT_BYTES = 4 << 20
_CONNECT_S = 10.0


@dataclass(frozen=True)
class PodInfo:
    """What the API says of a pod."""

    uid: str
    namespace: str
    name: str
    service_account: str
    node: str
    phase: str
    containers: frozenset[str] = frozenset()
    """The ids (64 hex, without the runtime's ``containerd://``) of the pod's containers,
    init and ephemeral ones too, as its status reports them (a container appears there once
    the runtime has made it)."""
    slots: int = 0
    """How many of the slot resource (``access.slot_resource``) the pod requests
    (:func:`pod_slots`); 0: none, or not read."""


_CONTAINER_ID = re.compile(f"[a-z0-9-]+://(?P<cid>{_CID})", re.ASCII)
_STATUS_LISTS = ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses")


def _containers(status: Any) -> frozenset[str]:
    out = set()
    for key in _STATUS_LISTS:
        for entry in status.get(key) or ():
            m = _CONTAINER_ID.fullmatch(str((entry or {}).get("containerID") or ""))
            if m:
                out.add(m["cid"])
    return frozenset(out)


_QUANTITY = re.compile(
    r"\+?(?P<n>[0-9]+)(?:(?P<suffix>[KMGTPE]i|[kMGTPE])|[eE]\+?(?P<exp>[0-9]{1,2}))?", re.ASCII)
_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _whole_quantity(value: Any) -> int:
    """A Kubernetes quantity that is a whole number (what an extended resource must be:
    "2", "1k", "1e3" as the API may write them back), as an int.

    Raises:
        ValueError: not a whole, non-negative quantity ("500m", "1.5", "x").
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _QUANTITY.fullmatch(str(value))
    if m is None:
        raise ValueError(f"not a whole quantity: {value!r}")
    scale = _SUFFIXES[m["suffix"]] if m["suffix"] else 10 ** int(m["exp"] or 0)
    return int(m["n"]) * scale


def pod_slots(spec: Any, resource: str) -> int:
    """How many of the extended resource ``resource`` a pod's ``spec`` requests, as the
    scheduler and a ResourceQuota count it: its containers' requests (a container's limit
    where it gives no request: an extended resource's request equals its limit) added up,
    sidecars (init containers with ``restartPolicy: Always``) with them, or an init
    container's with the sidecars started before it, whichever is more. 0: none requested,
    or ``resource`` is "".

    Raises:
        ValueError: a request that is not a whole quantity.
    """
    if not resource:
        return 0

    def of(container: Any) -> int:
        resources = (container or {}).get("resources") or {}
        for kind in ("requests", "limits"):
            value = (resources.get(kind) or {}).get(resource)
            if value is not None:
                return _whole_quantity(value)
        return 0

    regular = sum(of(c) for c in spec.get("containers") or ())
    sidecars = peak = 0
    for init in spec.get("initContainers") or ():
        if (init or {}).get("restartPolicy") == "Always":
            sidecars += of(init)
            peak = max(peak, sidecars)
        else:
            peak = max(peak, sidecars + of(init))
    return max(regular + sidecars, peak)


def _pod(obj: Any, slot_resource: str = "") -> tuple[PodInfo, bool] | None:
    """A pod object as (PodInfo, ended?) -- ended: deleting or finished; None if malformed.
    ``slot_resource``: the extended resource whose request is the pod's slots."""
    try:
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        info = PodInfo(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"],
                       service_account=spec.get("serviceAccountName") or "default",
                       node=spec.get("nodeName") or "", phase=status.get("phase") or "",
                       containers=_containers(status), slots=pod_slots(spec, slot_resource))
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    fields = (info.uid, info.namespace, info.name, info.service_account, info.node, info.phase)
    if not all(isinstance(f, str) for f in fields) or not _UID_FORM.fullmatch(info.uid):
        return None
    return info, bool(meta.get("deletionTimestamp")) or info.phase in _FINISHED_PHASES


class PodDirectory:
    """This node's pods, kept from the Kubernetes API by a thread: LIST, then WATCH from the
    list's resourceVersion (bookmarks keep it fresh; 410 Gone lists again; any other error
    is logged, kept in :attr:`last_error` and retried with backoff, watching on from the
    last resourceVersion). The bearer token is read from ``token_file`` at each connection
    (projected tokens rotate)."""

    def __init__(self, api_url: str, node_name: str, token_file: str | None = None,
                 ca_file: str | None = None, *, watch_timeout_s: int = 300,
                 backoff_s: tuple[float, float] = (0.2, 30.0), remember_deleted: int = 10000,
                 slot_resource: str = "") -> None:
        url = urllib.parse.urlsplit(api_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {api_url!r}")
        self.api_url, self.node_name = api_url, node_name
        self.token_file, self.ca_file = token_file, ca_file
        self.slot_resource = slot_resource  # whose request is a pod's slots ("": not read)
        self._https, self._host = url.scheme == "https", url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._watch_timeout_s, self._backoff_s = watch_timeout_s, backoff_s
        self._remember_deleted = remember_deleted
        self._changed = threading.Condition()
        self._pods: dict[str, PodInfo] = {}
        self._deleted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._rv = ""
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        self._conn_lock = threading.Lock()
        self.last_error: str | None = None
        """The error since the last good answer from the API; None while all is well."""
        self.live = False
        """Is a watch open (so what is held is current)?"""
        self.lists = 0
        """How many LISTs have been done (the first, and one per 410 Gone)."""

    @classmethod
    def in_cluster(cls, node_name: str, **kwargs: Any) -> PodDirectory:
        """The directory for a daemon running in a pod, with its service account's token."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeAPIError(None, "not in a cluster: KUBERNETES_SERVICE_HOST is not set")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", node_name, f"{SERVICE_ACCOUNT_DIR}/token",
                   f"{SERVICE_ACCOUNT_DIR}/ca.crt", **kwargs)

    # --- the reader's side

    @property
    def ready(self) -> bool:
        """Has the first LIST been done?"""
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def get(self, pod_uid: str, wait_s: float = 0.0) -> PodInfo | None:
        """The pod, if it is on this node and not deleted. A pod not seen yet is waited for
        up to ``wait_s``; a deleted (or terminating, or finished) one is None at once."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                if pod_uid in self._deleted:
                    return None
                if (info := self._pods.get(pod_uid)) is not None:
                    return info
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    return None
                self._changed.wait(left)

    def has_container(self, pod_uid: str, container_id: str, wait_s: float = 0.0) -> bool:
        """Does the API report ``container_id`` as one of the pod's containers? One not yet
        reported (the runtime made it, the status has not come through the watch) is waited
        for up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                info = self._pods.get(pod_uid)
                if info is not None and container_id in info.containers:
                    return True
                left = deadline - time.monotonic()
                if info is None or left <= 0 or self._stopping.is_set():
                    return False
                self._changed.wait(left)

    def deleted(self, pod_uid: str) -> bool:
        """Was the pod seen deleted, terminating or finished? (Forgotten after
        ``remember_deleted`` more deletions; it is then unknown, which is refused too.)"""
        with self._changed:
            return pod_uid in self._deleted

    @property
    def resource_version(self) -> str:
        """Where the watch is (the last event's or bookmark's resourceVersion)."""
        with self._changed:
            return self._rv

    def pods(self) -> list[PodInfo]:
        with self._changed:
            return list(self._pods.values())

    # --- the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaild-pods", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        with self._conn_lock:
            conn = self._conn
            if conn is not None and conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        delay = self._backoff_s[0]
        need_list = True
        while not self._stopping.is_set():
            try:
                try:
                    if need_list:
                        self._list()
                        need_list = False
                    self._watch()
                    delay = self._backoff_s[0]
                finally:
                    self.live = False
                    self._close()
            except KubeAPIGone:
                need_list = True
            except Exception as e:  # the thread must outlive any answer
                if self._stopping.is_set():
                    break
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("pods: %s (retrying in %.1f s)", self.last_error, delay)
                self._stopping.wait(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self._backoff_s[1])

    def _request(self, path: str, timeout_s: float) -> http.client.HTTPResponse:
        self._close()  # one request per connection
        conn: http.client.HTTPConnection
        if self._https:
            context = ssl.create_default_context(cafile=self.ca_file)
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=_CONNECT_S,
                                               context=context)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=_CONNECT_S)
        with self._conn_lock:  # so that stop() either sees this connection or stops it
            if self._stopping.is_set():
                raise OSError("stopping")
            self._conn = conn
            conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(timeout_s)
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            with open(self.token_file) as f:
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        conn.request("GET", path, headers=headers)
        response = self._response = conn.getresponse()
        if response.status != 200:
            body = response.read(1 << 16)
            if response.status == 410:
                raise KubeAPIGone(410, "the watch's resourceVersion is too old")
            raise KubeAPIError(response.status, _status_message(body) or response.reason)
        self.last_error = None
        return response

    def _close(self) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
            response, self._response = self._response, None
        if response is not None:
            response.close()  # it may own the socket (a response that closes the connection)
        if conn is not None:
            conn.close()

    def _path(self, **params: str) -> str:
        query = {"fieldSelector": f"spec.nodeName={self.node_name}", **params}
        return "/api/v1/pods?" + urllib.parse.urlencode(query)

    def _list(self) -> None:
        response = self._request(self._path(), 60)
        body = response.read(_MAX_LIST_BYTES + 1)
        if len(body) > _MAX_LIST_BYTES:
            raise ValueError("the pod list is too large")
        listed = json.loads(body)
        rv = listed["metadata"]["resourceVersion"]
        pods, ended = {}, []
        for obj in listed.get("items") or []:
            if (pod := _pod(obj, self.slot_resource)) is None or pod[0].node != self.node_name:
                continue
            if pod[1]:
                ended.append(pod[0].uid)
            else:
                pods[pod[0].uid] = pod[0]
        with self._changed:
            # what we held and the list lacks was deleted while we were not watching
            ended += [uid for uid in self._pods if uid not in pods]
            self._pods = {uid: p for uid, p in pods.items() if uid not in self._deleted}
            for uid in ended:
                self._forget(uid)
            self._rv = str(rv)
            self.lists += 1
            self._ready.set()
            self._changed.notify_all()

    def _watch(self) -> None:
        path = self._path(watch="1", resourceVersion=self._rv, allowWatchBookmarks="true",
                          timeoutSeconds=str(self._watch_timeout_s))
        response = self._request(path, self._watch_timeout_s + 30)
        self.live = True
        while not self._stopping.is_set():
            line = response.readline(_MAX_EVENT_BYTES)
            if not line:
                return  # the server ended the watch: watch again from where we are
            if not line.endswith(b"\n"):
                raise ValueError("a watch event is too large or cut short")
            self._event(json.loads(line))

    def _event(self, event: Any) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise KubeAPIGone(410, "the watch's resourceVersion is too old")
            raise KubeAPIError(obj.get("code"), obj.get("message") or "a watch error")
        with self._changed:
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if isinstance(rv, str) and rv:
                self._rv = rv
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                return  # BOOKMARK: only its resourceVersion
            if (pod := _pod(obj, self.slot_resource)) is None:
                log.warning("pods: a malformed pod in a %s event, ignored", kind)
                return
            info, ended = pod
            if kind == "DELETED" or ended:
                self._forget(info.uid)
            elif info.uid not in self._deleted and info.node == self.node_name:
                self._pods[info.uid] = info
            self._changed.notify_all()

    def _forget(self, uid: str) -> None:
        self._pods.pop(uid, None)
        self._deleted[uid] = None
        self._deleted.move_to_end(uid)
        while len(self._deleted) > self._remember_deleted:
            self._deleted.popitem(last=False)


def _status_message(body: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(body).get("message")
        if isinstance(message, str):
            return message
    return ""


__all__ = [
    "SO_PEERPIDFD", "KubeAPIError", "PeerUnverified", "PodDirectory", "PodInfo", "PodRef",
    "in_kubepods", "peer_cgroup", "peer_inode", "pod_of_cgroup", "pod_of_path",
]
