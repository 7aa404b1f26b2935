"""Compile a policy (and a job) into one description of its jail, and render it. Pure: no IO.

Theory of operation
-------------------
:func:`compile_policy` turns a policy (and, for one job, the job's facts) into a
:class:`JailPlan`: a typed, frozen description of the jail -- its mounts (binds,
tmpfs and proc with their options, each spelled once, here), namespaces, uid/gid
maps, rlimits, hostname, working directory, environment, cgroup ceilings, the
program it runs and the seccomp choice its runtime loads. Everything that makes
a jail reads that one description:

* spawn mode: :func:`render_config` renders the plan to an nsjail protobuf-text
  config. The daemon renders the policy's plan (its own limits, no job) once at
  start and hands it to every nsjail of that policy through a sealed memfd
  (``--config /proc/self/fd/N``; only the config file form can mount ``/proc``
  and binds ``nosuid,nodev,noexec``). :func:`render_argv` renders a job's plan
  to nsjail's command line: the job's uid/gid map, its (possibly tightened)
  rlimits, its cgroup parents, and the descriptor nsjail logs to.
* zygote mode: :func:`compile_zygote` is the plan of the policy's zygote (the
  same read-only frame, capabilities kept inside its user namespace, a full
  /proc, no per-job rlimits), rendered like a spawn jail's. A forked jail's plan
  (``compile_policy(..., forked=True)``) differs from a spawned one's only in who
  makes it: its :class:`~jaild.protocol.zygote_link.JailSetup` -- the per-jail
  part: fresh /tmp, /dev/shm and /proc, namespaces, hostname, cwd, rlimits, uid
  -- goes to the zygote as it is, in a ``SpawnJail`` message, and the zygote
  applies it (:mod:`jaild.runtime.zygote`). The read-only frame around it is the
  zygote's own, the same mounts. Under ``network.namespace = "tenant"`` a forked jail
  makes no network namespace: it joins the one its zygote keeps for its tenant
  (:func:`shared_net`, ``JailSetup.shared_net``).

The jail gets exactly three descriptors: fd 0 is the tool channel (a
socketpair, which the runtime moves out of the way and replaces with
/dev/null), fd 1 and fd 2 are pipes to the daemon. nsjail's own log goes to a
fourth descriptor the jail never sees.

Limits are enforced at the layer that can prove them: memory and pids by the
job's cgroup (set by the daemon on the job's parent cgroup, so OOM evidence
survives nsjail's cleanup; nsjail's child cgroup gets a higher ceiling only so
that it creates one), wall time by the daemon, CPU time / file size / open files
by rlimits, output by the daemon's byte count.

The kernel's per-user counts (queued signals, POSIX message queue bytes, locked
shared memory) are charged to the jail's uid and to the owner of every user
namespace above it; the daemon makes that owner a uid of the jail's own (see
:mod:`jaild.daemon.jails.launch.spawned`), but a zygote's jails all share the zygote's.
So every jail gets small, fixed rlimits for them (:data:`JAIL_SIGPENDING`,
:data:`JAIL_MSGQUEUE_BYTES`, :data:`JAIL_MEMLOCK_BYTES`): ``max_jobs`` jails at
their limits fit in what one host uid may hold, and no jail of a zygote can take
its siblings' share.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from jaild.policy.schema import (
    EGRESS_DOOR_PORT,
    JAIL_ROOT,
    Files,
    Filesystem,
    Limits,
    Network,
    Policy,
    resolve_env,
)
from jaild.policy.seccomp import SeccompChoice, network_refusal
from jaild.protocol import PROTOCOL_VERSION
from jaild.protocol.messages import Harden
from jaild.protocol.zygote_link import (
    MAX_SHARED_NET_CHARS,
    SHARED_NET_KEY,
    JailSetup,
    Mount,
    Rlimits,
)
from jaild.runtime.files import FileLimits

JAIL_ENV = f"{JAIL_ROOT}/env"
JAIL_RUNTIME = f"{JAIL_ROOT}/runtime"
JAIL_UID = 65534
JAIL_HOSTNAME = "jail"
WORKDIR = "/tmp"
MIB = 1024 * 1024

BOOTSTRAP = (
    f"import sys;sys.path.insert(0,{JAIL_RUNTIME!r});from jaild.runtime.main import main;main()"
)
"""The ``-c`` program: put the runtime on sys.path and run it. ``-I`` keeps cwd off sys.path."""

ZYGOTE_BOOTSTRAP = (
    f"import sys;sys.path.insert(0,{JAIL_RUNTIME!r});"
    "from jaild.runtime.zygote import main;main(sys.argv[1:])"
)
"""The zygote's ``-c`` program; its arguments are the modules to pre-import."""

ZYGOTE_PIDS = 4096
"""The zygote's pids cap: itself, plus forked jails until the daemon moves them out."""

JOB_UIDS = 65000
"""Job uids per daemon: ``uid_base`` .. ``uid_base + JOB_UIDS - 1``. The rest of the
daemon's 65536-uid block holds its zygotes' own uids."""

JAIL_ENVIRONMENT = (
    f"HOME={WORKDIR}",
    f"TMPDIR={WORKDIR}",
    f"PATH={JAIL_ENV}/bin:/usr/local/bin:/usr/bin:/bin",
    "LANG=C.UTF-8",
    "OMP_NUM_THREADS=1",
    "OPENBLAS_NUM_THREADS=1",
    "MKL_NUM_THREADS=1",
)
"""The jail's whole environment (nothing of the daemon's is kept)."""

EGRESS_PORT = EGRESS_DOOR_PORT
"""Where a ``network.mode = "egress"`` jail finds its proxy: ``127.0.0.1:3128`` on its own
loopback (each jail has its own network namespace, so every jail's is its own)."""
JAIL_TRUST = f"{JAIL_ROOT}/egress-trust.pem"
"""The CA bundle an egress jail trusts: the host's CAs and the daemon's interception CA."""
_PROXY = f"http://127.0.0.1:{EGRESS_PORT}"
EGRESS_ENVIRONMENT = (
    *(f"{name}={_PROXY}" for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")),
    *(f"{name}={_PROXY}" for name in ("http_proxy", "https_proxy", "all_proxy")),
    *(f"{name}={JAIL_TRUST}" for name in (
        "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")),
)
"""Added for ``network.mode = "egress"``: urllib, requests, httpx, aiohttp (``trust_env``),
pip and curl find the proxy and the trust bundle with no change to the code."""


def jail_environment(network: Network) -> tuple[str, ...]:
    """The environment of the policy's jails."""
    return (*JAIL_ENVIRONMENT, *EGRESS_ENVIRONMENT) if network.mode == "egress" else (
        JAIL_ENVIRONMENT)

JAIL_SIGPENDING = 64
"""RLIMIT_SIGPENDING of every jail: 512 jails hold 32,768 queued signals, under a host uid's
own limit (RLIMIT_SIGPENDING, RAM / 256 KiB: 32,768 on an 8 GiB host). Kernel-generated
signals (SIGCHLD, a timer's) are exempt; only ``sigqueue``-style signals are counted."""
JAIL_MSGQUEUE_BYTES = 1024
"""RLIMIT_MSGQUEUE of every jail: a small POSIX message queue (``mq_maxmsg`` x ``mq_msgsize``
plus the kernel's overhead); 512 jails hold 512 KiB, under a host uid's 800 KiB default."""
JAIL_MEMLOCK_BYTES = 16 * 1024
"""RLIMIT_MEMLOCK of every jail (``mlock``, ``shmctl(SHM_LOCK)``): 512 jails hold 8 MiB, a
host uid's default."""

DEVICES = (("null", True), ("zero", False), ("urandom", False), ("random", False))
"""The device nodes bound into every jail, and whether each is writable."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where the daemon's cgroup subtree lives. ``version`` is 1 or 2."""

    version: int
    subtree: str  # e.g. "jaild" -- relative to each v1 base, or to the v2 root
    # v1: the daemon's own cgroup in each hierarchy (its mount point, plus the daemon's
    # cgroup path below it: see jaild.daemon.jails.cgroups.detect); the subtree goes inside
    v1_bases: tuple[tuple[str, str], ...] = (
        ("memory", "/sys/fs/cgroup/memory"),
        ("pids", "/sys/fs/cgroup/pids"),
        ("cpu", "/sys/fs/cgroup/cpu"),
        ("cpuacct", "/sys/fs/cgroup/cpuacct"),
    )
    # v2: the cgroup the daemon owns (see jaild.daemon.jails.cgroups.place_v2); the subtree
    # goes inside it
    v2_root: str = "/sys/fs/cgroup"

    def v1_base(self, controller: str) -> str:
        return dict(self.v1_bases)[controller]


@dataclass(frozen=True)
class HostLayout:
    """Host facts the compiler needs, gathered by the daemon at start."""

    runtime_dir: str
    envs_dir: str
    cgroup: CgroupLayout
    egress_trust: str = ""
    """The host file an egress jail trusts (:data:`JAIL_TRUST`); "" when no policy egresses."""
    certifi: tuple[tuple[str, str], ...] = ()
    """(env directory, its certifi ``cacert.pem``) for the envs of egress policies: that
    file is covered by :attr:`egress_trust` in their jails, for code that asks certifi."""
    clone_into_cgroup: bool = False
    """Zygotes fork their jails straight into the jobs' cgroups (cgroup v2 and
    ``daemon.clone_into_cgroup``): a zygote then keeps the daemon's cgroup namespace, since
    ``clone3(CLONE_INTO_CGROUP)`` can only reach a cgroup below the root of the caller's
    (each jail makes a namespace of its own, rooted at its job's cgroup, as before)."""


@dataclass(frozen=True)
class JobPlacement:
    """Per-job facts chosen by the daemon."""

    job_id: str
    outside_uid: int
    config_path: str
    log_fd: int


@dataclass(frozen=True)
class JobFacts:
    """What a jail's plan takes from its job."""

    limits: Limits
    """The job's limits (the policy's, or tighter)."""
    uid: int
    """The job's own unprivileged host uid."""
    pooled: bool = False
    """Made ahead of its job, so it has time to warm up."""
    tenant: str = ""
    """The key of the tenant the jail is for (``Principal.key``, as text); "": unknown.
    A forked jail of a ``network.namespace = "tenant"`` policy shares its tenant's network
    namespace (:func:`shared_net`)."""


@dataclass(frozen=True)
class IdMap:
    """One line of a user namespace's uid (and gid) map."""

    inside: int
    outside: int
    count: int = 1

    def __str__(self) -> str:
        return f"{self.inside}:{self.outside}:{self.count}"


@dataclass(frozen=True)
class JailPlan:
    """One jail, described once: rendered to nsjail's config and command line, or sent
    (its :attr:`jail` part) to a zygote, which applies it."""

    name: str
    """The policy's name."""
    jail: JailSetup
    """The per-jail part: fresh mounts, namespaces, hostname, cwd, rlimits, uid."""
    frame: tuple[Mount, ...]
    """The read-only mounts before the jail's own: root, binds, symlinks, env, runtime."""
    devices: tuple[Mount, ...]
    """The device nodes, mounted last."""
    env: tuple[str, ...]
    id_maps: tuple[IdMap, ...]
    """The user namespace's uid map (the gid map is the same); empty in a policy's plan
    (no job yet) and in a forked jail's (the zygote's map applies)."""
    keep_caps: bool
    """Keep capabilities inside the user namespace (a zygote only)."""
    memory_max_bytes: int
    """nsjail's own cgroup ceiling (see :func:`child_memory_ceiling_bytes`)."""
    pids_max: int
    cpu_ms_per_sec: int
    """CPU bandwidth; 0 = no cpu controller."""
    cgroup_v2: bool
    program: tuple[str, ...]
    """What runs in the jail: the interpreter's path, then its argv (``argv[0]`` first)."""
    seccomp: SeccompChoice
    """The filters the runtime loads (built by :func:`jaild.policy.seccomp.build_spec`)."""

    @property
    def mounts(self) -> tuple[Mount, ...]:
        """Every mount of the jail, in order."""
        return (*self.frame, *self.jail.mounts, *self.devices)


def tmp_inodes(tmp_mb: int) -> int:
    """Files the /tmp tmpfs may hold: 256 per MB (at least 1024), so an inode flood ends in
    ENOSPC well before the inodes' own memory reaches the job's cgroup limit."""
    return max(1024, tmp_mb * 256)


def zygote_memory_mb(policy: Policy, max_jobs: int) -> int:
    """The zygote's cgroup memory limit. A jail runs a few lines in the zygote's cgroup before
    the daemon moves it to its job's, and the pages it touches there stay charged to the
    zygote's (cgroups do not move charges) until the jail exits: room for that, ~1 MB a
    job, on top of the zygote's own (twice the policy's limit)."""
    return 2 * policy.limits.memory_mb + max_jobs


def child_memory_ceiling_bytes(policy: Policy) -> int:
    """nsjail's own (child) cgroup ceiling: above the job's, so the job's limit trips first."""
    return 2 * policy.limits.memory_mb * MIB


# --------------------------------------------------------------------------- compile


def _tmpfs(target: str, size_mb: int, inodes: int) -> Mount:
    """A writable, hardened tmpfs: the only spelling of tmpfs options."""
    options = f"size={size_mb * MIB},mode=1777,nr_inodes={inodes}"
    return Mount(
        target, "tmpfs", options=options, writable=True, nosuid=True, nodev=True, noexec=True
    )


def _bind(source: str, target: str) -> Mount:
    return Mount(target, "bind", source=source, nosuid=True, nodev=True)


@functools.lru_cache(maxsize=64)
def _frame(policy: Policy, host: HostLayout) -> tuple[Mount, ...]:
    binds = policy.filesystem.binds
    # an empty, read-only root; everything else is mounted on it
    mounts = [Mount("/", "tmpfs", options="size=1048576,mode=0755", nosuid=True, nodev=True)]
    mounts += [_bind(b.src, b.dst) for b in binds]
    if any(b.dst == "/usr" for b in binds):
        mounts += [
            Mount(f"/{d}", "symlink", source=f"usr/{d}") for d in ("bin", "lib", "lib64", "sbin")
        ]
    env = resolve_env(policy, host.envs_dir)
    mounts.append(_bind(env, JAIL_ENV))
    mounts.append(_bind(host.runtime_dir, JAIL_RUNTIME))
    if policy.network.mode == "egress":
        trust = host.egress_trust or "<egress-trust.pem>"
        mounts.append(_bind(trust, JAIL_TRUST))
        mounts += [
            _bind(trust, JAIL_ENV + cacert[len(env):])
            for where, cacert in host.certifi
            if where == env and cacert.startswith(env + "/")
        ]
    return tuple(mounts)


@functools.lru_cache(maxsize=1)
def _devices() -> tuple[Mount, ...]:
    return tuple(
        Mount(f"/dev/{d}", "bind", source=f"/dev/{d}", writable=rw, nosuid=True, noexec=True)
        for d, rw in DEVICES
    )


@functools.lru_cache(maxsize=64)
def _fresh_mounts(fs: Filesystem, *, full_proc: bool) -> tuple[Mount, ...]:
    """The jail's writable mounts and /proc. A zygote always gets a full /proc: it needs its
    own pid namespace from there, and the kernel lets a jail mount its own proc only where a
    fully visible one exists; each jail detaches the zygote's (see jaild.runtime.zygote)."""
    mounts = [_tmpfs(WORKDIR, fs.tmp_mb, tmp_inodes(fs.tmp_mb))]
    if fs.shm_mb > 0:
        mounts.append(_tmpfs("/dev/shm", fs.shm_mb, 4096))
    if full_proc or fs.proc != "none":
        options = "subset=pid" if fs.proc == "pid-only" and not full_proc else ""
        mounts.append(Mount("/proc", "proc", options=options, nosuid=True, nodev=True, noexec=True))
    return tuple(mounts)


def _namespaces(network: Network, *, user: bool, shared: bool = False) -> tuple[str, ...]:
    own = ("user",) if user else ()
    net = ("net",) if network.mode != "host" and not shared else ()
    return (*own, "mount", "pid", "ipc", "uts", "cgroup", *net)


def shared_net(policy: Policy, job: JobFacts | None, *, forked: bool) -> str:
    """The key of the network namespace a jail shares, or "" (one of its own).

    Only a jail forked by a zygote shares one (the zygote makes and keeps it), only under a
    policy that says ``network.namespace = "tenant"`` (which the schema allows with modes
    ``none`` and ``loopback`` alone), and only for a known tenant: the key is the tenant's,
    so two tenants' jails never share one. Zygotes are per policy, so neither do two
    policies' jails, whatever ``daemon.zygote_scope`` says."""
    if not forked or job is None or not job.tenant or policy.network.namespace != "tenant":
        return ""
    key = job.tenant
    if len(key) <= MAX_SHARED_NET_CHARS and re.fullmatch(SHARED_NET_KEY, key):
        return key
    # (a principal's key is always a plain word today; any other stays one tenant's word)
    return "t-" + hashlib.sha256(key.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=256)
def _rlimits(limits: Limits) -> Rlimits:
    return Rlimits(
        cpu_s=limits.cpu_time_s,
        file_size_bytes=limits.file_size_mb * MIB,
        open_files=limits.open_files,
        core_bytes=0,
        sigpending=JAIL_SIGPENDING,
        msgqueue_bytes=JAIL_MSGQUEUE_BYTES,
        memlock_bytes=JAIL_MEMLOCK_BYTES,
    )


def _python(*args: str) -> tuple[str, ...]:
    return (f"{JAIL_ENV}/bin/python3", "python3", "-I", "-B", "-c", *args)


def _jail_setup(policy: Policy, job: JobFacts | None, *, forked: bool) -> JailSetup:
    """The per-jail part of :func:`compile_policy`'s plan."""
    shared = shared_net(policy, job, forked=forked)
    return JailSetup(
        uid=job.uid if forked and job is not None else JAIL_UID,
        hostname=JAIL_HOSTNAME,
        cwd=WORKDIR,
        namespaces=_namespaces(policy.network, user=not forked, shared=bool(shared)),
        mounts=_fresh_mounts(policy.filesystem, full_proc=False),
        rlimits=_rlimits(policy.limits if job is None else job.limits),
        loopback=policy.network.mode in ("loopback", "egress"),
        detach=_detach(policy.filesystem) if forked else (),
        warm_up=job is not None and job.pooled,
        shared_net=shared,
    )


def _detach(fs: Filesystem) -> tuple[str, ...]:
    """What a forked jail hides: the zygote's own fresh mounts (see :func:`compile_zygote`)."""
    return tuple(m.target for m in _fresh_mounts(fs, full_proc=True))


def harden(policy: Policy, seccomp_spec: dict[str, Any]) -> Harden:
    """The first frame to every jail of ``policy``, beside its plan: how the runtime locks
    itself down -- the seccomp filters built for the plan's :attr:`JailPlan.seccomp`
    (``seccomp_spec``, from :func:`jaild.policy.seccomp.build_spec`), the ``[files]``
    limits every run of the jail is held to, and, without a network, the refusal the
    runtime answers network attempts with."""
    return Harden(
        protocol=PROTOCOL_VERSION,
        seccomp=seccomp_spec,
        file_limits=file_limits(policy).to_wire(),
        network=network_refusal(policy.name, policy.network.mode),
    )


def file_limits(policy: Policy) -> FileLimits:
    """The policy's ``[files]`` limits, as the runtime checks them."""
    return _file_limits(policy.files)


@functools.lru_cache(maxsize=256)
def _file_limits(files: Files) -> FileLimits:
    return FileLimits.from_wire(dataclasses.asdict(files))


def compile_policy(
    policy: Policy, host: HostLayout, job: JobFacts | None = None, *, forked: bool = False
) -> JailPlan:
    """The plan of one jail of ``policy``.

    Args:
        policy: the jail's policy.
        host: where the runtime, the envs and the cgroups are.
        job: the job it is for; None for the policy's own plan (its limits, no uid
            map), which the daemon renders once into the policy's nsjail config.
        forked: a jail forked by the policy's zygote (needs ``job``) rather than
            spawned by nsjail: it runs as the job's uid in the zygote's user
            namespace and first hides the zygote's own fresh mounts.
    Returns:
        The plan; pure, the same inputs give an equal plan.
    """
    limits = policy.limits if job is None else job.limits
    if forked and job is None:
        raise ValueError("a forked jail's plan is a job's")
    return JailPlan(
        name=policy.name,
        jail=_jail_setup(policy, job, forked=forked),
        frame=_frame(policy, host),
        devices=_devices(),
        env=jail_environment(policy.network),
        id_maps=(IdMap(JAIL_UID, job.uid),) if job is not None and not forked else (),
        keep_caps=False,
        memory_max_bytes=child_memory_ceiling_bytes(policy),
        pids_max=limits.pids,
        cpu_ms_per_sec=max(1, round(limits.cpu_cores * 1000)) if limits.cpu_cores > 0 else 0,
        cgroup_v2=host.cgroup.version == 2,
        program=_python(BOOTSTRAP),
        seccomp=policy.seccomp_choice,
    )


def compile_zygote(
    policy: Policy, host: HostLayout, *, max_jobs: int = 512, uids: tuple[int, int] | None = None
) -> JailPlan:
    """The plan of ``policy``'s zygote: the same frame and namespaces as its jails, but
    capabilities kept inside its user namespace, a full /proc and no per-job rlimits
    (each jail it forks sets its own), running :mod:`jaild.runtime.zygote`.

    Args:
        uids: ``(zygote_uid, uid_base)``: inside uid 0 is the zygote's own host uid; the
            daemon's job uids map to themselves, so a forked jail can become one. None
            leaves the map out (the config does not carry it).
    """
    maps = (IdMap(0, uids[0]), IdMap(uids[1], uids[1], JOB_UIDS)) if uids is not None else ()
    jail = JailSetup(
        uid=0,
        hostname=JAIL_HOSTNAME,
        cwd=WORKDIR,
        namespaces=tuple(ns for ns in _namespaces(policy.network, user=True)
                         if ns != "cgroup" or not host.clone_into_cgroup),
        mounts=_fresh_mounts(policy.filesystem, full_proc=True),
        rlimits=None,
        loopback=policy.network.mode in ("loopback", "egress"),
    )
    return JailPlan(
        name=policy.name,
        jail=jail,
        frame=_frame(policy, host),
        devices=_devices(),
        env=jail_environment(policy.network),
        id_maps=maps,
        keep_caps=True,
        memory_max_bytes=zygote_memory_mb(policy, max_jobs) << 20,
        pids_max=ZYGOTE_PIDS,
        cpu_ms_per_sec=0,
        cgroup_v2=host.cgroup.version == 2,
        program=_python(ZYGOTE_BOOTSTRAP, *policy.pool.preimport),
        seccomp=policy.seccomp_choice,
    )


# --------------------------------------------------------------------------- render


def _q(s: str) -> str:
    """A protobuf text-format string literal."""
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{out}"'


def _bool(value: bool) -> str:
    return "true" if value else "false"


def render_mount(mount: Mount) -> str:
    """One ``mount { ... }`` line of nsjail's config."""
    if mount.kind == "symlink":
        return f"mount {{ src: {_q(mount.source)} dst: {_q(mount.target)} is_symlink: true }}"
    if mount.kind == "bind":
        parts = [f"src: {_q(mount.source)}", f"dst: {_q(mount.target)}", "is_bind: true"]
    else:
        parts = [f"dst: {_q(mount.target)}", f"fstype: {_q(mount.kind)}"]
        parts.append(f"options: {_q(mount.options)}")
    parts.append(f"rw: {_bool(mount.writable)}")
    parts += [f"{flag}: true" for flag in ("nosuid", "nodev", "noexec") if getattr(mount, flag)]
    return "mount { " + " ".join(parts) + " }"


def _render_rlimits(plan: JailPlan) -> list[str]:
    """rlimits: the address space is the cgroup's job (RLIMIT_AS breaks numpy); the stack
    keeps its soft limit. A plan without rlimits (a zygote) leaves them to its jails."""
    lines = ["rlimit_as_type: INF"]
    rl = plan.jail.rlimits
    lines.append(f"rlimit_core: {rl.core_bytes // MIB if rl is not None else 0}")
    if plan.keep_caps:
        lines.append("keep_caps: true")
    if rl is None:
        lines += ["rlimit_cpu_type: INF", "rlimit_fsize_type: INF", "rlimit_nofile_type: HARD"]
    else:
        lines += [
            f"rlimit_cpu: {rl.cpu_s}",
            f"rlimit_fsize: {rl.file_size_bytes // MIB}",
            f"rlimit_nofile: {rl.open_files}",
        ]
    return [*lines, "rlimit_stack_type: SOFT"]


def _render_kernel_quotas(plan: JailPlan) -> list[str]:
    """The rlimits on what the kernel counts per user (see the module docstring). nsjail
    cannot set RLIMIT_SIGPENDING: a spawned jail keeps nsjail's, and its queued signals are
    charged to its own uid, which owns its user namespace and nothing else."""
    rl = plan.jail.rlimits
    if rl is None:
        return []
    return [
        f"rlimit_memlock: {rl.memlock_bytes // 1024}",  # KiB
        "rlimit_memlock_type: VALUE",
        f"rlimit_msgqueue: {rl.msgqueue_bytes}",
        "rlimit_msgqueue_type: VALUE",
    ]


def _render_namespaces(jail: JailSetup) -> list[str]:
    ns = set(jail.namespaces)
    clone = [("net", "net"), ("user", "user"), ("ns", "mount"), ("pid", "pid")]
    clone += [("ipc", "ipc"), ("uts", "uts"), ("cgroup", "cgroup")]
    lines = [f"clone_new{flag}: {_bool(name in ns)}" for flag, name in clone]
    return [*lines, f"iface_no_lo: {_bool('net' in ns and not jail.loopback)}"]


def render_config(plan: JailPlan) -> str:
    """``plan`` as nsjail's protobuf-text config (its per-job parts are on the command line,
    see :func:`render_argv`)."""
    jail = plan.jail
    lines = [
        f"# jaild policy {plan.name!r} -- generated; do not edit",
        f"name: {_q('jaild-' + plan.name)}",
        "mode: ONCE",
        f"hostname: {_q(jail.hostname)}",
        f"cwd: {_q(jail.cwd)}",
        "time_limit: 0",  # the daemon enforces wall time, to ~100 ms
        "keep_env: false",
        *(f"envar: {_q(var)}" for var in plan.env),
        "skip_setsid: false",
        "disable_no_new_privs: false",
        *_render_rlimits(plan),
        *_render_namespaces(jail),
        "mount_proc: false",
        *(render_mount(m) for m in plan.mounts),
        f"cgroup_mem_max: {plan.memory_max_bytes}",
        "cgroup_mem_swap_max: 0",
        *_render_kernel_quotas(plan),
    ]
    if plan.cgroup_v2:
        lines.append("use_cgroupv2: true")
    path, arg0, *args = plan.program
    lines += ["exec_bin {", f"  path: {_q(path)}", f"  arg0: {_q(arg0)}"]
    lines += [f"  arg: {_q(arg)}" for arg in args]
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_argv(
    plan: JailPlan, nsjail: str, config_path: str, log_fd: int, cgroup: CgroupLayout, rel: str
) -> list[str]:
    """nsjail's command line for ``plan`` (its config does the rest): the uid/gid map, the
    job's rlimits, and its cgroups below ``rel`` (a cgroup the daemon made)."""
    argv = [nsjail, "--config", config_path, "--log_fd", str(log_fd)]
    for flag in ("--user", "--group"):
        for idmap in plan.id_maps:
            argv += [flag, str(idmap)]
    rl = plan.jail.rlimits
    if rl is not None:
        argv += ["--rlimit_cpu", str(rl.cpu_s), "--rlimit_fsize", str(rl.file_size_bytes // MIB)]
        argv += ["--rlimit_nofile", str(rl.open_files)]
    argv += ["--cgroup_pids_max", str(plan.pids_max)]
    if plan.cpu_ms_per_sec > 0:
        argv += ["--cgroup_cpu_ms_per_sec", str(plan.cpu_ms_per_sec)]
    return argv + _cgroup_args(cgroup, rel, cpu=plan.cpu_ms_per_sec > 0)


def _cgroup_args(cg: CgroupLayout, rel: str, *, cpu: bool) -> list[str]:
    """Where nsjail puts its child's cgroups: below ``rel`` (which the daemon made)."""
    if cg.version == 2:
        return ["--cgroupv2_mount", f"{cg.v2_root}/{rel}"]
    args = [
        "--cgroup_mem_mount",
        cg.v1_base("memory"),
        "--cgroup_mem_parent",
        rel,
        "--cgroup_pids_mount",
        cg.v1_base("pids"),
        "--cgroup_pids_parent",
        rel,
    ]
    if cpu:
        args += ["--cgroup_cpu_mount", cg.v1_base("cpu"), "--cgroup_cpu_parent", rel]
    return args


# --------------------------------------------------------------------------- the daemon's calls


def nsjail_config(
    policy: Policy, host: HostLayout, *, zygote: bool = False, max_jobs: int = 512
) -> str:
    """The nsjail config shared by every job of ``policy`` -- or, with ``zygote``, the
    config of the policy's zygote (see :func:`compile_zygote`)."""
    plan = (
        compile_zygote(policy, host, max_jobs=max_jobs) if zygote else compile_policy(policy, host)
    )
    return render_config(plan)


def job_cgroup_relpath(host: HostLayout, job_id: str) -> str:
    return f"{host.cgroup.subtree}/{job_id}"


def job_argv(
    nsjail: str, policy: Policy, limits: Limits, host: HostLayout, job: JobPlacement
) -> list[str]:
    """nsjail's command line for one job (the config does the rest)."""
    plan = compile_policy(policy, host, JobFacts(limits, job.outside_uid))
    rel = job_cgroup_relpath(host, job.job_id)
    return render_argv(plan, nsjail, job.config_path, job.log_fd, host.cgroup, rel)


def zygote_argv(
    nsjail: str,
    policy: Policy,
    host: HostLayout,
    config_path: str,
    log_fd: int,
    zygote_uid: int,
    uid_base: int,
    cgroup: str = "",
) -> list[str]:
    """nsjail's command line for a zygote of ``policy``, in the daemon's cgroup ``cgroup``
    (default ``zygote-<policy>``; one per client uid: see jaild.daemon.jails.launch.zygotes)."""
    plan = compile_zygote(policy, host, uids=(zygote_uid, uid_base))
    rel = f"{host.cgroup.subtree}/{cgroup or 'zygote-' + policy.name}"
    return render_argv(plan, nsjail, config_path, log_fd, host.cgroup, rel)


def forked_jail(policy: Policy, host: HostLayout, job: JobFacts) -> JailSetup:
    """What ``policy``'s zygote is sent for one jail: the per-jail part of its plan,
    ``compile_policy(policy, host, job, forked=True).jail`` -- only that part is made,
    since the daemon asks for it per job."""
    return _jail_setup(policy, job, forked=True)
