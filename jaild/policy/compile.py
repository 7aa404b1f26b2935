"""Compile a policy (and a job) into what nsjail and the runtime need. Pure: no IO.

Theory of operation
-------------------
A job's jail is described in two layers:

* :func:`nsjail_config` -- everything that depends only on the policy and the
  host layout, as an nsjail protobuf-text config. The daemon builds it once per
  policy at start and hands it to every nsjail of that policy through a sealed
  memfd (``--config /proc/self/fd/N``). The config file form is needed because
  only it can mount ``/proc`` and binds ``nosuid,nodev,noexec``.
* :func:`job_argv` -- the per-job part, on nsjail's command line: the job's
  cgroup parents, its own unprivileged uid/gid outside the jail, the job's
  (possibly tightened) rlimits, and the descriptor nsjail logs to.

The jail gets exactly three descriptors: fd 0 is the tool channel (a
socketpair, which the runtime moves out of the way and replaces with
/dev/null), fd 1 and fd 2 are pipes to the daemon. nsjail's own log goes to a
fourth descriptor the jail never sees.

Limits are enforced at the layer that can prove them: memory and pids by the
job's cgroup (set by the daemon on the job's parent cgroup, so OOM evidence
survives nsjail's cleanup; nsjail's child cgroup gets a higher ceiling only so
that it creates one), wall time by the daemon, CPU time / file size / open files
by rlimits, output by the daemon's byte count.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

from jaild.policy.schema import JAIL_ROOT, Limits, Policy, resolve_env

JAIL_ENV = f"{JAIL_ROOT}/env"
JAIL_RUNTIME = f"{JAIL_ROOT}/runtime"
JAIL_UID = 65534
JAIL_HOSTNAME = "jail"
WORKDIR = "/tmp"

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


@dataclass(frozen=True)
class CgroupLayout:
    """Where the daemon's cgroup subtree lives. ``version`` is 1 or 2."""

    version: int
    subtree: str  # e.g. "jaild" -- relative to each v1 controller mount, or to the v2 root
    v1_mounts: tuple[tuple[str, str], ...] = (
        ("memory", "/sys/fs/cgroup/memory"),
        ("pids", "/sys/fs/cgroup/pids"),
        ("cpu", "/sys/fs/cgroup/cpu"),
        ("cpuacct", "/sys/fs/cgroup/cpuacct"),
    )
    # v2: the cgroup the daemon owns (see jaild.daemon.cgroups.place_v2); the subtree goes inside it
    v2_root: str = "/sys/fs/cgroup"

    def v1_mount(self, controller: str) -> str:
        return dict(self.v1_mounts)[controller]


@dataclass(frozen=True)
class HostLayout:
    """Host facts the compiler needs, gathered by the daemon at start."""

    runtime_dir: str
    envs_dir: str
    cgroup: CgroupLayout


@dataclass(frozen=True)
class JobPlacement:
    """Per-job facts chosen by the daemon."""

    job_id: str
    outside_uid: int
    config_path: str
    log_fd: int


def _q(s: str) -> str:
    """A protobuf text-format string literal."""
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{out}"'


def _mount(**fields: str | bool) -> str:
    parts = []
    for key, value in fields.items():
        if isinstance(value, bool):
            parts.append(f"{key}: {'true' if value else 'false'}")
        else:
            parts.append(f"{key}: {_q(value)}")
    return "mount { " + " ".join(parts) + " }"


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
    return 2 * policy.limits.memory_mb * 1024 * 1024


def nsjail_config(
    policy: Policy, host: HostLayout, *, zygote: bool = False, max_jobs: int = 512
) -> str:
    """The nsjail protobuf-text config shared by every job of ``policy`` -- or, with
    ``zygote``, the config of the policy's zygote: the same mounts and namespaces, but
    capabilities kept inside its user namespace and no per-job rlimits (each jail it
    forks sets its own), running :mod:`jaild.runtime.zygote`."""
    lim = policy.limits
    fs = policy.filesystem
    env_dir = resolve_env(policy, host.envs_dir)
    lines = [
        f"# jaild policy {policy.name!r} -- generated; do not edit",
        f"name: {_q('jaild-' + policy.name)}",
        "mode: ONCE",
        f"hostname: {_q(JAIL_HOSTNAME)}",
        f"cwd: {_q(WORKDIR)}",
        "time_limit: 0",  # the daemon enforces wall time, to ~100 ms
        "keep_env: false",
        f"envar: {_q('HOME=' + WORKDIR)}",
        f"envar: {_q('TMPDIR=' + WORKDIR)}",
        f"envar: {_q('PATH=' + JAIL_ENV + '/bin:/usr/local/bin:/usr/bin:/bin')}",
        f"envar: {_q('LANG=C.UTF-8')}",
        f"envar: {_q('OMP_NUM_THREADS=1')}",
        f"envar: {_q('OPENBLAS_NUM_THREADS=1')}",
        f"envar: {_q('MKL_NUM_THREADS=1')}",
        "skip_setsid: false",
        "disable_no_new_privs: false",
        "rlimit_as_type: INF",  # memory is the cgroup's job; RLIMIT_AS breaks numpy
        "rlimit_core: 0",
        *(
            [
                "keep_caps: true",
                "rlimit_cpu_type: INF",
                "rlimit_fsize_type: INF",
                "rlimit_nofile_type: HARD",
            ]
            if zygote
            else [
                f"rlimit_cpu: {lim.cpu_time_s}",
                f"rlimit_fsize: {lim.file_size_mb}",
                f"rlimit_nofile: {lim.open_files}",
            ]
        ),
        "rlimit_stack_type: SOFT",
        f"clone_newnet: {'false' if policy.network.mode == 'host' else 'true'}",
        "clone_newuser: true",
        "clone_newns: true",
        "clone_newpid: true",
        "clone_newipc: true",
        "clone_newuts: true",
        "clone_newcgroup: true",
        f"iface_no_lo: {'true' if policy.network.mode == 'none' else 'false'}",
        "mount_proc: false",
        # an empty, read-only root; everything else is mounted on it
        _mount(
            dst="/",
            fstype="tmpfs",
            options="size=1048576,mode=0755",
            rw=False,
            nosuid=True,
            nodev=True,
        ),
    ]
    for bind in fs.binds:
        lines.append(
            _mount(src=bind.src, dst=bind.dst, is_bind=True, rw=False, nosuid=True, nodev=True)
        )
    for link in ("bin", "lib", "lib64", "sbin"):
        if any(b.dst == "/usr" for b in fs.binds):
            lines.append(_mount(src=f"usr/{link}", dst=f"/{link}", is_symlink=True))
    lines += [
        _mount(src=env_dir, dst=JAIL_ENV, is_bind=True, rw=False, nosuid=True, nodev=True),
        _mount(
            src=host.runtime_dir, dst=JAIL_RUNTIME, is_bind=True, rw=False, nosuid=True, nodev=True
        ),
        _mount(
            dst=WORKDIR,
            fstype="tmpfs",
            options=f"size={fs.tmp_mb * 1024 * 1024},mode=1777,nr_inodes={tmp_inodes(fs.tmp_mb)}",
            rw=True,
            nosuid=True,
            nodev=True,
            noexec=True,
        ),
    ]
    if fs.shm_mb > 0:
        lines.append(
            _mount(
                dst="/dev/shm",
                fstype="tmpfs",
                options=f"size={fs.shm_mb * 1024 * 1024},mode=1777,nr_inodes=4096",
                rw=True,
                nosuid=True,
                nodev=True,
                noexec=True,
            )
        )
    if fs.proc != "none" or zygote:
        # The zygote always gets a full /proc: it needs its own pid namespace from there,
        # and the kernel lets a jail mount its own proc only where a fully visible one
        # exists; each jail detaches the zygote's (see jaild.runtime.zygote).
        options = "subset=pid" if fs.proc == "pid-only" and not zygote else ""
        lines.append(
            _mount(
                dst="/proc",
                fstype="proc",
                options=options,
                rw=False,
                nosuid=True,
                nodev=True,
                noexec=True,
            )
        )
    for dev, rw in (("null", True), ("zero", False), ("urandom", False), ("random", False)):
        lines.append(
            _mount(
                src=f"/dev/{dev}", dst=f"/dev/{dev}", is_bind=True, rw=rw, nosuid=True, noexec=True
            )
        )
    lines += [
        "cgroup_mem_max: "
        + str(
            zygote_memory_mb(policy, max_jobs) << 20
            if zygote
            else child_memory_ceiling_bytes(policy)
        ),
        "cgroup_mem_swap_max: 0",
    ]
    if host.cgroup.version == 2:
        lines.append("use_cgroupv2: true")
    lines.append("exec_bin {")
    lines.append(f"  path: {_q(JAIL_ENV + '/bin/python3')}")
    lines.append(f"  arg0: {_q('python3')}")
    args = (
        ["-I", "-B", "-c", ZYGOTE_BOOTSTRAP, *policy.pool.preimport]
        if zygote
        else ["-I", "-B", "-c", BOOTSTRAP]
    )
    for arg in args:
        lines.append(f"  arg: {_q(arg)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def job_cgroup_relpath(host: HostLayout, job_id: str) -> str:
    return f"{host.cgroup.subtree}/{job_id}"


def job_argv(
    nsjail: str, policy: Policy, limits: Limits, host: HostLayout, job: JobPlacement
) -> list[str]:
    """nsjail's command line for one job (the config does the rest)."""
    rel = job_cgroup_relpath(host, job.job_id)
    ids = f"{JAIL_UID}:{job.outside_uid}:1"
    argv = [
        nsjail,
        "--config",
        job.config_path,
        "--log_fd",
        str(job.log_fd),
        "--user",
        ids,
        "--group",
        ids,
        "--rlimit_cpu",
        str(limits.cpu_time_s),
        "--rlimit_fsize",
        str(limits.file_size_mb),
        "--rlimit_nofile",
        str(limits.open_files),
        "--cgroup_pids_max",
        str(limits.pids),
    ]
    if limits.cpu_cores > 0:
        argv += ["--cgroup_cpu_ms_per_sec", str(max(1, round(limits.cpu_cores * 1000)))]
    return argv + _cgroup_args(host.cgroup, rel, cpu=limits.cpu_cores > 0)


def _cgroup_args(cg: CgroupLayout, rel: str, *, cpu: bool) -> list[str]:
    """Where nsjail puts its child's cgroups: below ``rel`` (which the daemon made)."""
    if cg.version == 2:
        return ["--cgroupv2_mount", f"{cg.v2_root}/{rel}"]
    args = [
        "--cgroup_mem_mount",
        cg.v1_mount("memory"),
        "--cgroup_mem_parent",
        rel,
        "--cgroup_pids_mount",
        cg.v1_mount("pids"),
        "--cgroup_pids_parent",
        rel,
    ]
    if cpu:
        args += ["--cgroup_cpu_mount", cg.v1_mount("cpu"), "--cgroup_cpu_parent", rel]
    return args


def zygote_argv(
    nsjail: str,
    policy: Policy,
    host: HostLayout,
    config_path: str,
    log_fd: int,
    zygote_uid: int,
    uid_base: int,
) -> list[str]:
    """nsjail's command line for the zygote of ``policy``: inside uid 0 is the zygote's own
    host uid; the daemon's job uids map to themselves, so a forked jail can become one."""
    rel = f"{host.cgroup.subtree}/zygote-{policy.name}"
    argv = [nsjail, "--config", config_path, "--log_fd", str(log_fd)]
    for flag in ("--user", "--group"):
        argv += [flag, f"0:{zygote_uid}:1", flag, f"{uid_base}:{uid_base}:{JOB_UIDS}"]
    argv += ["--cgroup_pids_max", str(ZYGOTE_PIDS)]
    return argv + _cgroup_args(host.cgroup, rel, cpu=False)


def zygote_request(
    policy: Policy, limits: Limits, uid: int, *, pooled: bool = False
) -> dict[str, Any]:
    """What the zygote needs to make one jail of ``policy`` (see :mod:`jaild.daemon.launch.forked`):
    the same /tmp, /dev/shm, /proc, hostname, network and rlimits nsjail would give it;
    ``pooled`` jails have time to warm up while they wait for their job."""
    fs = policy.filesystem
    mib = 1024 * 1024
    return {
        "uid": uid,
        "rlimits": [
            [resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s],
            [resource.RLIMIT_FSIZE, limits.file_size_mb * mib, limits.file_size_mb * mib],
            [resource.RLIMIT_NOFILE, limits.open_files, limits.open_files],
            [resource.RLIMIT_CORE, 0, 0],
        ],
        "tmp": f"size={fs.tmp_mb * mib},mode=1777,nr_inodes={tmp_inodes(fs.tmp_mb)}",
        "shm": f"size={fs.shm_mb * mib},mode=1777,nr_inodes=4096" if fs.shm_mb > 0 else "",
        "proc": fs.proc,
        "netns": policy.network.mode != "host",
        "loopback": policy.network.mode == "loopback",
        "hostname": JAIL_HOSTNAME,
        "warm_up": pooled,
    }
