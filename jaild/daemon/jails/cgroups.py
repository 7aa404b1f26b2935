"""The daemon's cgroup subtree: one cgroup per job, with limits and evidence.

Theory of operation
-------------------
The daemon owns a subtree (``jaild`` by default) and creates one cgroup per
job inside it, *before* starting nsjail. nsjail is told to use that job cgroup
as its parent, so the jailed process ends up in ``<subtree>/<job>/NSJAIL.<pid>``.

The job cgroup -- not nsjail's child cgroup -- carries the memory limit (and
swap 0), so an OOM kill happens *at the job cgroup*, where the daemon can see
it after the fact: nsjail removes its child cgroup when the child dies, taking
its counters with it.

* cgroup v1 (this kind of host): limits in ``memory.limit_in_bytes`` and
  ``memory.memsw.limit_in_bytes``; OOM evidence from an eventfd registered on
  ``memory.oom_control`` (v1's ``oom_kill`` counter is not hierarchical);
  peak from ``memory.max_usage_in_bytes``; CPU time from ``cpuacct`` (its own
  hierarchy here, or co-mounted with ``cpu``); peak processes from ``pids.peak``.
* cgroup v2 (systemd hosts): ``memory.max``, ``memory.swap.max``; OOM evidence
  from ``memory.events`` (hierarchical); peak from ``memory.peak`` (kernel >= 5.19,
  else absent); CPU time from ``cpu.stat``; peak processes from ``pids.peak`` (where
  the kernel has it, else absent).

Where the v2 subtree goes (:func:`place_v2`)
-------------------------------------------
cgroup v2 has one writer per subtree and one rule that shapes everything: a cgroup
that hands controllers to its children (``cgroup.subtree_control``) holds no
processes itself. So the daemon first finds a cgroup it *owns* -- its ``base`` --,
moves itself into a leaf ``base/daemon``, and creates ``base/<subtree>/<job>``
beside that leaf. Nothing goes at the top of /sys/fs/cgroup unless no systemd runs.

* ``delegated``: started by systemd with ``Delegate=yes`` (jaild.service). The
  daemon's own cgroup (``/system.slice/jaild.service``) carries systemd's
  ``trusted.delegate`` mark and holds nobody else: it is the base. A ``MemoryMax=``
  on the service then caps every jail, and ``systemctl status`` counts them.
* ``scope``: started from a shell on a systemd host (a session scope it does not
  own). The daemon asks systemd for a transient scope ``<subtree>.scope`` with
  ``Delegate=yes`` -- ``systemd-run --scope`` makes it around a placeholder, and
  the daemon moves itself in, so it is not re-executed. As root, ``systemd-run``
  talks to systemd on its own socket (``/run/systemd/private``), as ``systemctl``
  does: no D-Bus is needed (a minimal Debian 12 has systemd without one). A
  scope left by a crashed daemon of the same instance (its jails may still be in
  it) is joined, so the sweep finds them.
* ``root``: no systemd, and the daemon is in the root cgroup (exempt from the rule):
  the base is /sys/fs/cgroup itself.
* ``container``: in a container (a private cgroup namespace, whose root is the
  container's cgroup and not the real root; or a runtime's marker, see
  :func:`in_container`) with no systemd of its own: the container's cgroup. Every
  process of the container is the container's, so its init (tini) moves into the
  leaf with the daemon. A pod's limits then cap the jails, and deleting the pod takes
  their cgroups along.
* ``own``: no systemd, in a cgroup of its own: that cgroup, if nothing else lives in it.

On cgroup v1 there is no such rule; the subtree still goes inside the daemon's own
cgroup of each hierarchy (:func:`v1_bases`: a container's, whatever its runtime mounted).

Anything else fails the start with a message saying what to do.

The memory ceiling
------------------
The subtree as a whole carries a memory limit (:meth:`Cgroups.limit_memory`,
``limits.max_memory_mb``): whatever the jails, sessions, warm jails and zygotes do,
together they never hold more. Admission keeps the jails' own limits within it.

The counters a run reads and resets (peaks, CPU time, OOM events) are opened once,
when the job's cgroup is made -- off any job's path for a pooled jail -- and read with
``pread`` at offset 0 (:meth:`JobCgroup.keep_counters_open`): an open, read and close of
a cgroup file costs ~15 us, a ``pread`` ~1 us. They stay open only while the daemon has
fds to spare (under half its ``RLIMIT_NOFILE``); otherwise each read opens its file.

Jailed code cannot touch any of this: it has no /sys, a private cgroup
namespace, and no privilege.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from jaild.errors import CgroupError
from jaild.policy.compile import CgroupLayout

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
OPTIONAL_V1 = ("cpu", "cpuacct")


def detect(subtree: str, pid: int | str = "self") -> CgroupLayout:
    """Pick cgroup v2 if the unified hierarchy is mounted at /sys/fs/cgroup, else v1 -- with
    the subtree inside the daemon's (``pid``'s) own cgroup of each v1 hierarchy
    (:func:`v1_bases`)."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return CgroupLayout(version=2, subtree=subtree)
    if os.path.isdir("/sys/fs/cgroup/memory") and os.path.isdir("/sys/fs/cgroup/pids"):
        return CgroupLayout(version=1, subtree=subtree, v1_bases=v1_bases(pid))
    raise CgroupError(
        "no usable cgroups: neither cgroup v2 at /sys/fs/cgroup nor v1 memory+pids hierarchies"
    )


def v1_bases(
    pid: int | str = "self", mountinfo: str | None = None, cgroups: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The directory of ``pid``'s own cgroup in each v1 hierarchy jaild uses, as seen here.

    A hierarchy's mount shows the cgroup tree from its root (``/proc/PID/mountinfo``'s
    fourth field) down: ``/`` on a host; the container's own cgroup in a container, whose
    runtime bind-mounts just that; ``/`` again where a container was given the host's
    ``/sys/fs/cgroup``. ``pid``'s cgroup path (``/proc/PID/cgroup``) below that root,
    joined to the mount point, is its cgroup's directory: job cgroups go there, so a
    container's (a pod's) limits cap them and deleting it takes them along, whatever the
    runtime mounted. A hierarchy not mounted keeps the default path (it is optional or
    reported missing by :meth:`Cgroups.prepare`). ``mountinfo``/``cgroups``: the two files'
    text (tests)."""
    if mountinfo is None:
        mountinfo = _read(f"/proc/{pid}/mountinfo")
    if cgroups is None:
        cgroups = _read(f"/proc/{pid}/cgroup")
    own: dict[str, str] = {}
    for line in cgroups.splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            own[c] = path
    mounts: dict[str, tuple[str, str]] = {}  # controller -> (mount point, root)
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] != "cgroup":
            continue
        for c in fields[sep + 3].split(","):
            mounts.setdefault(c, (fields[4], fields[3]))
    bases = []
    for controller, default in CgroupLayout(1, "").v1_bases:
        if controller not in mounts or controller not in own:
            bases.append((controller, default))
            continue
        point, root = mounts[controller]
        path = own[controller]
        if root == "/":
            below = path
        elif path == root or path.startswith(root + "/"):
            below = path[len(root):]
        else:
            below = ""  # not under the mount's root: the mount point is all we see of it
        if ".." in below.split("/"):  # outside our cgroup namespace's root: likewise
            below = ""
        bases.append((controller, os.path.normpath(point + "/" + below.lstrip("/"))))
    return tuple(bases)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_bytes(path: str) -> bytes:
    """A small cgroup file's content, in one read (no text layer)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _cgroup_dirs(directory: str) -> list[str]:
    """``directory`` and the cgroups below it, deepest first. On cgroupfs a directory's link
    count is 2 plus its subdirectories: a job's cgroup with none (a zygote jail's on v1)
    costs one ``stat``, not a listing of its ~30 control files.

    Raises:
        FileNotFoundError: ``directory`` is gone.
    """
    if os.stat(directory).st_nlink <= 2:
        return [directory]
    return [root for root, _dirs, _files in os.walk(directory, topdown=False)]


def _kill_members(directory: str) -> int:
    """SIGKILL every process in ``directory`` and its descendants; returns how many.

    On v2 kernels with ``cgroup.kill`` (5.14+) the kernel kills the whole subtree at once,
    forks in flight included; the walk below then only counts (and catches stragglers)."""
    killed = 0
    try:
        dirs = _cgroup_dirs(directory)
    except FileNotFoundError:
        return 0
    if _has_cgroup_kill(directory):
        with contextlib.suppress(OSError):  # the cgroup may be going away
            _write(os.path.join(directory, "cgroup.kill"), "1")
    for root in dirs:
        try:
            pids = _read_bytes(os.path.join(root, "cgroup.procs")).split()
        except OSError:
            continue
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
    return killed


_CGROUP_KILL: dict[str, bool] = {}


def _has_cgroup_kill(directory: str) -> bool:
    """Does the hierarchy of cgroup ``directory`` have ``cgroup.kill`` (v2 on 5.14+; never
    v1)? Looked up once per parent (a subtree's jobs all answer alike), on the parent: a
    cgroup too, and not one going away."""
    parent = os.path.dirname(directory)
    known = _CGROUP_KILL.get(parent)
    if known is None:
        known = _CGROUP_KILL[parent] = os.path.exists(os.path.join(parent, "cgroup.kill"))
    return known


def _rmtree_cgroup(directory: str, timeout_s: float = 2.0) -> None:
    """Remove a cgroup directory bottom-up (cgroupfs wants rmdir, not unlink). The common
    case, an empty cgroup with no cgroups below it, is one ``rmdir``."""
    try:
        os.rmdir(directory)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            raise
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for root, dirs, _files in os.walk(directory, topdown=False):
                for d in dirs:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.join(root, d))
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(directory)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            _kill_members(directory)
            time.sleep(0.01)


UNLIMITED = 1 << 62
"""At or above this a memory limit is v1's "no limit" (``PAGE_COUNTER_MAX`` in bytes)."""


def memory_limit_mb(pid: int | str = "self") -> int | None:
    """The tightest memory limit on ``pid``'s cgroup and every cgroup above it that can be
    seen, in MiB: a container's or pod's limit. None: no limit.

    v1: ``hierarchical_memory_limit`` of ``memory.stat`` (the kernel's minimum over the
    ancestors). v2: the smallest ``memory.max`` from the cgroup up to /sys/fs/cgroup (in a
    private cgroup namespace, the container's own cgroup)."""
    limits: list[int] = []
    if os.path.exists(os.path.join(V2_MOUNT, "cgroup.controllers")):
        directory = _v2_dir(cgroup_of(pid))
        while directory.startswith(V2_MOUNT):
            with contextlib.suppress(OSError, ValueError):
                text = _read(os.path.join(directory, "memory.max")).strip()
                if text != "max":
                    limits.append(int(text))
            if directory == V2_MOUNT:
                break
            directory = os.path.dirname(directory)
    else:
        memory = dict(v1_bases(pid))["memory"]
        with contextlib.suppress(OSError, ValueError):
            for line in _read(os.path.join(memory, "memory.stat")).splitlines():
                if line.startswith("hierarchical_memory_limit "):
                    limits.append(int(line.split()[1]))
    limit = min(limits, default=UNLIMITED)
    return None if limit >= UNLIMITED else limit // (1024 * 1024)


# ------------------------------------------------------------------ v2 placement

V2_MOUNT = "/sys/fs/cgroup"
DAEMON_LEAF = "daemon"
V2_CONTROLLERS = "+memory +pids +cpu"


@dataclass(frozen=True)
class Placement:
    """Where a cgroup v2 daemon keeps its cgroups, and why there.

    ``base`` is the cgroup directory the daemon owns; job cgroups go in
    ``base/<subtree>``. ``leaf`` is the daemon's own cgroup inside it (None: it stays
    in the root cgroup). ``how`` is ``delegated``, ``scope``, ``root``, ``container`` or ``own``
    (see the module docstring); ``detail`` says it in a sentence for logs and doctor.
    """

    base: str
    leaf: str | None
    how: str
    detail: str


def cgroup_of(pid: int | str = "self") -> str:
    """The v2 cgroup path of ``pid`` (``/system.slice/jaild.service``), from /proc."""
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    raise CgroupError(f"process {pid} is in no cgroup v2 hierarchy")


def _v2_dir(path: str) -> str:
    return os.path.normpath(V2_MOUNT + "/" + path.lstrip("/"))


def _delegated(directory: str) -> bool:
    """Did systemd delegate this cgroup (``Delegate=yes``)? It marks it with an xattr."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(directory, name) == b"1":
                return True
    return False


def _procs(directory: str) -> set[int]:
    try:
        return {int(p) for p in _read(os.path.join(directory, "cgroup.procs")).split()}
    except (OSError, ValueError):
        return set()


def _systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


def _join(directory: str, pid: int) -> None:
    """Move ``pid`` (every thread of it) into the cgroup ``directory``, made if missing."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory)
    _write(os.path.join(directory, "cgroup.procs"), str(pid))


def _scope_holder(unit: str, timeout_s: float) -> subprocess.Popen[bytes]:
    """Have ``systemd-run --scope`` make the transient scope ``unit`` (``Delegate=yes``)
    around a placeholder process, and return that process once it is in the scope.

    As root, ``systemd-run`` without ``--wait`` or ``--pty`` talks to the manager on its
    own socket (``/run/systemd/private``), as ``systemctl`` does, so this works with no
    D-Bus installed (a minimal Debian 12); the daemon then moves itself in by writing the
    cgroup, and the placeholder goes.

    Raises:
        CgroupError: systemd-run is missing, failed (its message included), or the
            placeholder was not in the scope within ``timeout_s``.
    """
    run = shutil.which("systemd-run")
    if run is None:
        raise CgroupError("systemd-run (systemd) is missing")
    holder = subprocess.Popen(
        [
            run, "--scope", "--quiet", f"--unit={unit}", "--collect",
            "--property=Delegate=yes",
            "--description=jaild daemon (started outside systemd)",
            "--", "sleep", "infinity",
        ],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if holder.poll() is not None:  # systemd-run exits only when it failed
            assert holder.stderr is not None
            raise CgroupError(holder.stderr.read().decode(errors="replace").strip()
                              or f"systemd-run exited {holder.returncode}")
        with contextlib.suppress(OSError, CgroupError):  # exec()s sleep once placed
            if cgroup_of(holder.pid).endswith("/" + unit):
                return holder
        time.sleep(0.01)
    _end(holder)
    raise CgroupError(f"systemd did not make the scope {unit} in {timeout_s:.0f} s")


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def _start_scope(unit: str, pid: int, timeout_s: float = 10.0) -> str:
    """Get a transient scope ``unit`` with ``Delegate=yes`` from systemd and move ``pid``
    into its ``daemon`` leaf (what ``systemd-run --scope -p Delegate=yes`` does, without
    re-executing). Returns the scope's cgroup path. If a scope of that name still runs --
    left by a crashed daemon of this socket, with whatever the crash left in it -- ``pid``
    joins it, so the sweep finds that."""
    for _attempt in range(3):  # a scope left by a crash may be collected while we look
        try:
            holder = _scope_holder(unit, timeout_s)
        except CgroupError as exc:
            if "already exists" not in str(exc) and "already loaded" not in str(exc):
                raise CgroupError(f"systemd refused the scope {unit}: {exc}") from None
        else:
            try:
                scope = cgroup_of(holder.pid)
                _join(_v2_dir(scope + "/" + DAEMON_LEAF), pid)
            finally:
                _end(holder)  # the scope's top must hold no process once it delegates
            return scope
        shown = subprocess.run(
            ["systemctl", "show", "--property=ControlGroup", "--value", unit],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        ).stdout.strip()
        if shown and os.path.isdir(_v2_dir(shown)):
            try:
                _join(_v2_dir(shown + "/" + DAEMON_LEAF), pid)
            except FileNotFoundError:
                continue  # collected just now: make it anew
            return shown
    raise CgroupError(f"the scope {unit} exists but keeps vanishing; `systemctl stop {unit}`")


CONTAINER_MARKERS = ("/run/.containerenv", "/.dockerenv")
"""Files container runtimes leave in the root of a container (podman's, Docker's)."""


def in_container() -> bool:
    """Does this process run in a container? Podman and Docker leave a marker file (and
    podman the ``container`` variable); every Kubernetes pod has ``KUBERNETES_SERVICE_HOST``
    (containerd and CRI-O leave no file)."""
    if os.environ.get("container") or os.environ.get("KUBERNETES_SERVICE_HOST"):  # noqa: SIM112
        return True
    return any(os.path.exists(m) for m in CONTAINER_MARKERS)


def _namespace_root() -> bool:
    """Is /sys/fs/cgroup the root of a private cgroup namespace rather than the real root?
    Only non-root cgroups have ``cgroup.type``."""
    return os.path.exists(os.path.join(V2_MOUNT, "cgroup.type"))


def place_v2(subtree: str) -> Placement:
    """Find (or make) the cgroup this daemon owns, and move the daemon into its leaf.

    Raises:
        CgroupError: no usable place; the message says what to do.
    """
    pid = os.getpid()
    own = cgroup_of()
    parent = os.path.dirname(own)
    if os.path.basename(own) == DAEMON_LEAF and (_delegated(_v2_dir(parent)) or in_container()):
        own = parent  # placed already (a daemon started twice in a process)
    here = _v2_dir(own)
    others = _procs(here) - {pid}
    if own == "/" and not _namespace_root():
        return Placement(V2_MOUNT, None, "root", "the root cgroup (no systemd manages cgroups)")
    if own == "/" or (in_container() and not _systemd_running()):
        where = "the root of its private cgroup namespace" if own == "/" else own
        how, detail = "container", f"its container's cgroup ({where})"
        if others:  # the container's init (tini): the cgroup that delegates holds nobody
            for other in sorted(others):
                with contextlib.suppress(OSError):  # gone meanwhile
                    _join(os.path.join(here, DAEMON_LEAF), other)
            detail += f"; the container's other {len(others)} process(es) moved in with it"
    elif _systemd_running():
        if _delegated(here) and not others:
            how, detail = "delegated", f"delegated by systemd (Delegate=yes) at {own}"
        else:
            unit = f"{subtree}.scope"
            why = "not delegated" if not _delegated(here) else "shared with other processes"
            try:
                own = _start_scope(unit, pid)
            except (CgroupError, OSError, subprocess.SubprocessError) as exc:
                raise CgroupError(
                    f"cgroup v2: the daemon's cgroup {own} is {why}, and no delegated scope "
                    f"could be made ({exc}). Run jaild as the systemd service (make install; "
                    f"systemctl enable --now jaild.socket), or start it with "
                    f"`systemd-run --scope -p Delegate=yes jaild serve ...`"
                ) from None
            here = _v2_dir(own)
            how, detail = "scope", f"transient scope {unit} with Delegate=yes at {own} ({why})"
    else:
        if others:
            raise CgroupError(
                f"cgroup v2 without systemd: the daemon's cgroup {own} also holds processes "
                f"{sorted(others)[:5]}; start jaild in a cgroup of its own (or in the root one)"
            )
        how, detail = "own", f"its own cgroup {own} (no systemd)"
    leaf = os.path.join(here, DAEMON_LEAF)
    if cgroup_of() != os.path.join(own, DAEMON_LEAF):
        _join(leaf, pid)
    return Placement(here, leaf, how, detail)


def daemon_subtree_dirs(pid: int, layout: CgroupLayout) -> list[str]:
    """Where the daemon ``pid`` keeps its job cgroups (tests and ``jaild doctor`` look there).

    v1: ``<base>/<subtree>`` in each hierarchy, the base being the daemon's own cgroup
    (:func:`v1_bases`). v2: ``<base>/<subtree>``, the base being the parent of the daemon's
    ``daemon`` leaf, or the root cgroup."""
    if layout.version == 1:
        return Cgroups(dataclasses.replace(layout, v1_bases=v1_bases(pid))).subtree_dirs()
    own = cgroup_of(pid)
    base = os.path.dirname(own) if os.path.basename(own) == DAEMON_LEAF else own
    return [os.path.join(_v2_dir(base), layout.subtree)]


@dataclass
class JobCgroup:
    """The cgroup(s) of one job."""

    layout: CgroupLayout
    dirs: list[str] = field(default_factory=list)
    memory_dir: str = ""
    pids_dir: str = ""
    cpu_dir: str = ""  # v1, with a CPU cap
    acct_dir: str = ""  # v1: where CPU time is counted
    leaf: str = ""
    """v2, a job made for a zygote's home: the leaf its zygote forks the jail into."""
    _oom_eventfd: int = -1
    _oom_control_fd: int = -1
    _kept: dict[str, int] = field(default_factory=dict)  # counter path -> its open fd
    _kept_lock: threading.Lock = field(default_factory=threading.Lock)

    def keep_counters_open(self) -> None:
        """Open the files a run reads and resets (see the module docstring)."""
        if self.layout.version == 1:
            rw = [os.path.join(self.memory_dir, "memory.max_usage_in_bytes")]
            ro = [os.path.join(self.pids_dir, "pids.peak")] if self.pids_dir else []
            if self.acct_dir:
                rw.append(os.path.join(self.acct_dir, "cpuacct.usage"))
                ro.append(os.path.join(self.acct_dir, "cpuacct.usage_all"))
        else:
            rw = []
            ro = [os.path.join(self.memory_dir, name)
                  for name in ("memory.events", "memory.peak", "pids.peak", "cpu.stat")]
        spare = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2
        with self._kept_lock:
            for path, flags in [(p, os.O_RDWR) for p in rw] + [(p, os.O_RDONLY) for p in ro]:
                try:
                    fd = os.open(path, flags | os.O_CLOEXEC)
                except OSError:
                    continue  # absent on this kernel: read as ever (and found absent)
                if fd >= spare:  # fds are short: keep them for what cannot do without
                    os.close(fd)
                    return
                self._kept[path] = fd

    def _close_counters(self) -> None:
        with self._kept_lock:
            kept, self._kept = self._kept, {}
            for fd in kept.values():
                os.close(fd)

    def _read(self, path: str) -> str:
        with self._kept_lock:  # not closed (and its number reused) under the read
            fd = self._kept.get(path)
            if fd is not None:
                data = os.pread(fd, 1 << 16, 0)
                if len(data) < 1 << 16:
                    return data.decode("ascii")
        return _read(path)

    def _write(self, path: str, value: str) -> None:
        with self._kept_lock:
            fd = self._kept.get(path)
            if fd is not None:
                os.pwrite(fd, value.encode(), 0)
                return
        _write(path, value)

    def oom_killed(self) -> bool:
        """Did the kernel OOM-kill anything in this job's cgroup?"""
        if self.layout.version == 1:
            if self._oom_eventfd < 0:
                return False
            try:
                return os.eventfd_read(self._oom_eventfd) > 0
            except BlockingIOError:
                return False
        try:
            for line in self._read(os.path.join(self.memory_dir, "memory.events")).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        except OSError:
            pass
        return False

    def peak_memory_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.layout.version == 1 else "memory.peak"
        try:
            return int(self._read(os.path.join(self.memory_dir, name)))
        except (OSError, ValueError):
            return None

    def memory_bytes(self) -> int | None:
        """Memory the job uses now."""
        name = "memory.usage_in_bytes" if self.layout.version == 1 else "memory.current"
        try:
            return int(_read(os.path.join(self.memory_dir, name)))
        except (OSError, ValueError):
            return None

    def reset_peak_memory(self) -> None:
        """Start a new peak (v1; a session's next run). v2 keeps the jail's peak."""
        if self.layout.version == 1:
            with contextlib.suppress(OSError):
                self._write(os.path.join(self.memory_dir, "memory.max_usage_in_bytes"), "0")

    def peak_pids(self) -> int | None:
        try:
            return int(self._read(os.path.join(self.pids_dir or self.memory_dir, "pids.peak")))
        except (OSError, ValueError):
            return None

    def start_cpu_count(self) -> tuple[float, float] | None:
        """Begin counting a run's CPU time: the baseline to subtract from :meth:`cpu_times`.
        v1 resets the job's ``cpuacct`` counters (one write), so the baseline is zero; v2's
        ``cpu.stat`` cannot be reset and is read."""
        if self.layout.version == 1 and self.acct_dir:
            try:
                self._write(os.path.join(self.acct_dir, "cpuacct.usage"), "0")
            except OSError:
                return self.cpu_times()
            return (0.0, 0.0)
        return self.cpu_times()

    def cpu_times(self) -> tuple[float, float] | None:
        """(user, system) CPU seconds of everything that ran in the job's cgroup."""
        try:
            if self.layout.version == 1:
                if not self.acct_dir:
                    return None
                # usage is exact; the user/system split is counted in ticks: scale it
                total = int(self._read(os.path.join(self.acct_dir, "cpuacct.usage")))
                user = system = 0
                per_cpu = self._read(
                    os.path.join(self.acct_dir, "cpuacct.usage_all")
                ).splitlines()
                for line in per_cpu[1:]:
                    _, u, s = line.split()
                    user += int(u)
                    system += int(s)
                share = user / (user + system) if user + system else 1.0
                return total * share / 1e9, total * (1 - share) / 1e9
            stat = dict(
                line.split(" ", 1)
                for line in self._read(os.path.join(self.memory_dir, "cpu.stat")).splitlines()
            )
            return int(stat["user_usec"]) / 1e6, int(stat["system_usec"]) / 1e6
        except (OSError, ValueError, KeyError):
            return None

    def member_pids(self, jail_only: bool = False) -> list[int]:
        """Processes in the job's cgroups. ``jail_only``: those of the memory hierarchy,
        where only the jail lives (v1 spawn mode starts nsjail itself in ``cpuacct``)."""
        pids: set[int] = set()
        for d in [self.memory_dir] if jail_only else self.dirs:
            for root, _dirs, files in os.walk(d):
                name = "cgroup.procs" if "cgroup.procs" in files else "tasks"
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in _read(os.path.join(root, name)).split())
        return sorted(pids)

    def limits(self) -> dict[str, int | None]:
        """The memory, memory+swap and pids limits in force on the job's cgroup."""

        def number(path: str) -> int | None:
            try:
                text = _read(path).strip()
            except OSError:
                return None
            return None if text == "max" else int(text)

        if self.layout.version == 1:
            pids_dir = self.pids_dir or self.memory_dir
            return {
                "memory_limit": number(os.path.join(self.memory_dir, "memory.limit_in_bytes")),
                "memsw_limit": number(os.path.join(self.memory_dir, "memory.memsw.limit_in_bytes")),
                "pids_max": number(os.path.join(pids_dir, "pids.max")),
            }
        memory = number(os.path.join(self.memory_dir, "memory.max"))
        swap = number(os.path.join(self.memory_dir, "memory.swap.max"))
        return {
            "memory_limit": memory,
            "memsw_limit": memory if swap == 0 else None if swap is None else -1,
            "pids_max": number(os.path.join(self.memory_dir, "pids.max")),
        }

    def adopt(self, pid: int) -> None:
        """Move ``pid`` (a zygote-forked jail) into this job's cgroup(s).

        In v2 the job's directory delegates its controllers, so a process may only
        live in a leaf: ``jail`` below it."""
        if self.layout.version == 1:
            for d in self.dirs:
                _write(os.path.join(d, "cgroup.procs"), str(pid))
            return
        leaf = os.path.join(self.memory_dir, "jail")
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        _write(os.path.join(leaf, "cgroup.procs"), str(pid))

    def limit_cpu(self, cores: float) -> None:
        """At most ``cores`` CPUs' worth of time (CFS quota per 100 ms period)."""
        quota = max(1000, round(cores * 100_000))
        if self.layout.version == 1:
            if self.cpu_dir:  # create_job with_cpu
                _write(os.path.join(self.cpu_dir, "cpu.cfs_period_us"), "100000")
                _write(os.path.join(self.cpu_dir, "cpu.cfs_quota_us"), str(quota))
            return
        _write(os.path.join(self.memory_dir, "cpu.max"), f"{quota} 100000")

    def kill_all(self) -> int:
        return sum(_kill_members(d) for d in self.dirs)

    def kill_jail(self) -> int:
        """SIGKILL the jail's processes: those of the memory hierarchy's job cgroup (v1) or
        of the job's cgroup (v2), and below. Every process of a jail is there -- a zygote
        jail is moved into each of its hierarchies' cgroups, nsjail puts its child into each
        -- and a jail cannot move itself; nsjail itself, outside it on v1, is killed apart.
        One hierarchy to read where :meth:`kill_all` reads each."""
        return _kill_members(self.memory_dir) if self.memory_dir else self.kill_all()

    def remove(self) -> None:
        self._close_counters()
        for fd in (self._oom_eventfd, self._oom_control_fd):
            if fd >= 0:
                os.close(fd)
        self._oom_eventfd = self._oom_control_fd = -1
        for d in self.dirs:
            _rmtree_cgroup(d)


class Cgroups:
    """The daemon's subtree. ``prepare`` once at start; ``create_job`` per job."""

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout
        self.placement: Placement | None = None  # v2, once prepared
        self._hierarchies: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        self._memsw: bool | None = None  # v1: is swap accounted (memory.memsw.* present)?

    def _v1_hierarchies(self, controllers: tuple[str, ...]) -> list[tuple[str, str]]:
        """(controller, real hierarchy) for each of ``controllers`` mounted (cpuacct is
        optional), found once: the mounts do not move under a running daemon."""
        found = self._hierarchies.get(controllers)
        if found is None:
            found = []
            for controller in controllers:
                mount = self.layout.v1_base(controller)
                if controller == "cpuacct" and not os.path.isdir(mount):
                    continue
                found.append((controller, os.path.realpath(mount)))
            self._hierarchies[controllers] = found
        return found

    def _v1_root(self, controller: str) -> str:
        return os.path.join(self.layout.v1_base(controller), self.layout.subtree)

    def _v1_roots(self) -> list[str]:
        """The subtree in each mounted v1 hierarchy, once each (cpu and cpuacct are often
        one hierarchy mounted twice)."""
        seen: dict[str, str] = {}
        for c in V1_CONTROLLERS:
            mount = self.layout.v1_base(c)
            if os.path.isdir(mount):
                seen.setdefault(os.path.realpath(mount), self._v1_root(c))
        return list(seen.values())

    def _comounted(self, a: str, b: str) -> bool:
        return os.path.realpath(self.layout.v1_base(a)) == os.path.realpath(
            self.layout.v1_base(b)
        )

    def _v2_root(self) -> str:
        return os.path.join(self.layout.v2_root, self.layout.subtree)

    def prepare(self) -> None:
        if self.layout.version == 1:
            for controller in V1_CONTROLLERS:
                mount = self.layout.v1_base(controller)
                if not os.path.isdir(mount):
                    if controller in OPTIONAL_V1:
                        continue
                    raise CgroupError(f"cgroup v1 {controller} hierarchy missing at {mount}")
                try:
                    os.makedirs(self._v1_root(controller), exist_ok=True)
                except OSError as exc:
                    raise CgroupError(
                        f"cannot create {self._v1_root(controller)}: {exc.strerror} "
                        "(the daemon must run as root or own a delegated cgroup)"
                    ) from None
            return
        if self.placement is None:
            self.placement = place_v2(self.layout.subtree)
            self.layout = dataclasses.replace(self.layout, v2_root=self.placement.base)
        base, root = self.placement.base, self._v2_root()
        try:
            os.makedirs(root, exist_ok=True)
            _write(os.path.join(base, "cgroup.subtree_control"), V2_CONTROLLERS)
            _write(os.path.join(root, "cgroup.subtree_control"), V2_CONTROLLERS)
        except OSError as exc:
            raise CgroupError(
                f"cannot enable the memory, pids and cpu controllers in {root} "
                f"({self.placement.detail}): {exc.strerror}. The cgroup must be delegated "
                "to the daemon (systemd: Delegate=yes) and hold no process itself"
            ) from None

    def limit_memory(self, memory_mb: int) -> None:
        """Cap the whole subtree's memory at ``memory_mb`` (no swap beyond it): every job,
        session, warm jail and zygote of the daemon together (``limits.max_memory_mb``).

        v1: ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` on the subtree in
        the memory hierarchy, which must be hierarchical (``memory.use_hierarchy`` 1, set
        here if it is not; possible only while the subtree has no children). v2:
        ``memory.max`` and ``memory.swap.max`` on ``base/<subtree>``.

        Raises:
            CgroupError: the limit cannot be set (what holds the memory, if it is in use).
        """
        limit = str(memory_mb * 1024 * 1024)
        if self.layout.version == 1:
            root = self._v1_root("memory")
            hierarchy = os.path.join(root, "memory.use_hierarchy")
            try:
                if _read(hierarchy).strip() != "1":
                    _write(hierarchy, "1")
                # memsw >= memory at every step: raise memsw first if it is lower, else memory
                pairs = [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)]
                memsw = os.path.join(root, pairs[1][0])
                if not os.path.exists(memsw):
                    pairs = pairs[:1]
                elif int(_read(memsw)) < int(limit):
                    pairs.reverse()
                for name, value in pairs:
                    _write(os.path.join(root, name), value)
            except (OSError, ValueError) as exc:
                raise CgroupError(
                    f"cannot set the memory ceiling of {root} to {memory_mb} MiB "
                    f"(limits.max_memory_mb): {exc}"
                ) from None
            return
        root = self._v2_root()
        try:
            _write(os.path.join(root, "memory.max"), limit)
            with contextlib.suppress(FileNotFoundError):
                _write(os.path.join(root, "memory.swap.max"), "0")
        except OSError as exc:
            raise CgroupError(
                f"cannot set the memory ceiling of {root} to {memory_mb} MiB "
                f"(limits.max_memory_mb): {exc}"
            ) from None

    def memory_limit_bytes(self) -> int | None:
        """The subtree's memory limit in force (None: none, or unreadable)."""
        if self.layout.version == 1:
            path = os.path.join(self._v1_root("memory"), "memory.limit_in_bytes")
        else:
            path = os.path.join(self._v2_root(), "memory.max")
        try:
            text = _read(path).strip()
        except OSError:
            return None
        return None if text == "max" else int(text)

    def subtree_dirs(self) -> list[str]:
        """The subtree's directories: one per v1 hierarchy, or the one v2 directory."""
        return self._v1_roots() if self.layout.version == 1 else [self._v2_root()]

    def create_home(self, label: str, owner_uid: int) -> str:
        """v2: the cgroup ``label`` under the subtree, for a zygote that forks its jails
        straight into their jobs' cgroups (:meth:`create_job` with ``home``): nsjail puts the
        zygote in a cgroup below it, the jobs' cgroups are made below it too, and its
        ``cgroup.procs`` belongs to the zygote's host uid. The kernel lets a process place
        another (``clone3(CLONE_INTO_CGROUP)`` as a write to ``cgroup.procs``) only if it may
        write the ``cgroup.procs`` of the target and of the common ancestor of the two: here,
        this directory and the job's leaf alone -- never the subtree's, another zygote's or a
        job's limits. No limit is set on it: the zygote's own are nsjail's, on its cgroup
        below, and each job's on its own. Made afresh if it is there (a zygote restarted).

        Raises:
            CgroupError: it cannot be made.
        """
        home = os.path.join(self._v2_root(), label)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(home)
            _write(os.path.join(home, "cgroup.subtree_control"), V2_CONTROLLERS)
            os.chown(os.path.join(home, "cgroup.procs"), owner_uid, -1)
        except OSError as exc:
            raise CgroupError(f"cannot set up the cgroup of zygote {label}: {exc}") from None
        return home

    def remove_home(self, label: str) -> None:
        """Remove the zygote home ``label`` and what is left below it (its zygote stopped:
        its jails died with it)."""
        home = os.path.join(self._v2_root(), label)
        _kill_members(home)
        _rmtree_cgroup(home)

    def create_job(
        self, job_id: str, memory_mb: int, pids: int, with_cpu: bool, *,
        home: tuple[str, int] | None = None,
    ) -> JobCgroup:
        """The cgroup(s) of job ``job_id``, with its limits.

        Args:
            home: v2, ``(label, uid)``: the job's cgroup goes below the zygote home ``label``
                (:meth:`create_home`), with its leaf ``jail`` made at once and its
                ``cgroup.procs`` given to ``uid`` (that zygote's), which forks the jail
                into it (:attr:`JobCgroup.leaf`).

        Raises:
            CgroupError: it cannot be made (nothing of it is left).
        """
        limit = str(memory_mb * 1024 * 1024)
        job = JobCgroup(self.layout)
        try:
            if self.layout.version == 1:
                made: dict[str, str] = {}  # real hierarchy -> the job's directory in it
                controllers = ("memory", "pids", "cpu", "cpuacct") if with_cpu else (
                    "memory", "pids", "cpuacct")
                for controller, hierarchy in self._v1_hierarchies(controllers):
                    d = made.get(hierarchy)
                    if d is None:
                        d = os.path.join(self._v1_root(controller), job_id)
                        os.mkdir(d)
                        job.dirs.append(d)
                        made[hierarchy] = d
                    setattr(job, {"memory": "memory_dir", "pids": "pids_dir", "cpu": "cpu_dir",
                                  "cpuacct": "acct_dir"}[controller], d)
                _write(os.path.join(job.memory_dir, "memory.limit_in_bytes"), limit)
                memsw = os.path.join(job.memory_dir, "memory.memsw.limit_in_bytes")
                if self._memsw is None:
                    self._memsw = os.path.exists(memsw)
                if self._memsw:
                    _write(memsw, limit)
                _write(os.path.join(job.pids_dir, "pids.max"), str(pids))
                job._oom_eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                job._oom_control_fd = os.open(
                    os.path.join(job.memory_dir, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC
                )
                _write(
                    os.path.join(job.memory_dir, "cgroup.event_control"),
                    f"{job._oom_eventfd} {job._oom_control_fd}",
                )
            else:
                parent = self._v2_root() if home is None else os.path.join(
                    self._v2_root(), home[0])
                d = os.path.join(parent, job_id)
                os.mkdir(d)
                job.dirs.append(d)
                job.memory_dir = job.pids_dir = d
                _write(os.path.join(d, "cgroup.subtree_control"), V2_CONTROLLERS)
                _write(os.path.join(d, "memory.max"), limit)
                with contextlib.suppress(FileNotFoundError):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(pids))
                if home is not None:
                    leaf = os.path.join(d, "jail")
                    os.mkdir(leaf)
                    os.chown(os.path.join(leaf, "cgroup.procs"), home[1], -1)
                    job.leaf = leaf
            job.keep_counters_open()
        except OSError as exc:
            with contextlib.suppress(OSError):
                job.remove()
            raise CgroupError(f"cannot set up the cgroup of job {job_id}: {exc}") from None
        return job

    def job_dirs(self) -> list[str]:
        """Existing job cgroups in the subtree (for sweeping what a crash left)."""
        out = []
        for root in self.subtree_dirs():
            with contextlib.suppress(FileNotFoundError):
                out += [
                    os.path.join(root, d)
                    for d in os.listdir(root)
                    if os.path.isdir(os.path.join(root, d))
                ]
        return out

    def remove_subtree(self) -> None:
        """Remove the (empty) subtree at shutdown; a non-empty one is left for the next sweep."""
        for root in self.subtree_dirs():
            with contextlib.suppress(OSError):
                os.rmdir(root)

    def sweep(self) -> list[str]:
        """Kill and remove every job cgroup left in the subtree; returns the jobs swept."""
        jobs = set()
        for d in self.job_dirs():
            _kill_members(d)
            with contextlib.suppress(OSError):
                _rmtree_cgroup(d)
                jobs.add(os.path.basename(d))
        return sorted(jobs)
