"""Start-up and tear-down of what a daemon serves with.

Theory of operation
-------------------
:func:`start` runs once, in this order, and refuses to start (:class:`StartupError`,
listing every reason) at the first step that fails:

1. load and check every policy, against this host too (``check_policy_files``);
2. claim the listening socket (systemd's, or bind our own: a second daemon for the
   same socket stops here, before it touches the cgroup subtree the first one uses);
3. check that jails can be made here -- the jail uid block clear of the kubelet's, and
   claim it (a second instance on it stops here: :mod:`jaild.daemon.uidblock`), and
   the daemon's privilege (:func:`~jaild.daemon.selftest.privilege_checks`: an
   unprivileged container fails closed, with the doctor's words) -- and start the
   metrics listener (a busy port refuses the start before any jail exists);
4. prepare the cgroup subtree (v2: move the daemon into the cgroup it owns), and
   **serve the socket**: from here a client that connects gets its ``Welcome`` at once,
   saying the daemon is starting; what needs no jail is answered, what needs one waits
   for readiness, for ``limits.startup_wait_s`` at most
   (:mod:`jaild.daemon.core.readiness`; ``progress`` is told each phase); then sweep what
   a crashed daemon left;
5. find nsjail and setpriv (which starts every nsjail as the host uid that is to own
   its jail's user namespace, with the daemon's capabilities as ambient ones, see
   :func:`jaild.daemon.jails.launch.spawned.as_owner`), become a child subreaper, stage the
   runtime, seal one nsjail config per policy in a memfd, compile the seccomp programs;
6. start the zygotes (a policy whose zygote does not come up is not served), run
   the policies' self-tests (one that fails is not served), start the warm pools;
7. log what it serves. The daemon (``server.Daemon.start``) then loads the runs parked
   for approval and the snapshots, opens its network listeners, is ready -- the requests
   that waited go on -- and only then tells systemd ``READY=1``.

Everything it makes is kept in one :class:`Served`; a failed start undoes what it
made (the subtree is ours, since we hold the socket), and :meth:`Served.release`
undoes it at stop. A start that fails before it serves answers the connections waiting
in the socket's backlog with the reason (:func:`answer_waiting`); one that fails after
leaves its connections to the daemon, which tells them the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import grp
import logging
import os
import resource
import secrets
import shutil
import socket
import stat
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from jaild import loops
from jaild.daemon import systemd
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Tenant
from jaild.daemon.core.readiness import Phase
from jaild.daemon.egress.service import EgressService, certifi_bundles
from jaild.daemon.egress.service import Observer as EgressObserver
from jaild.daemon.jails.cgroups import Cgroups, detect
from jaild.daemon.jails.job import CallReply, JailedJob, JailEnvironment, JobSpec, ToolObserver
from jaild.daemon.jails.kernlog import KernelAuditLog
from jaild.daemon.jails.launch.forked import Zygote
from jaild.daemon.jails.launch.spawned import owner_caps, sweep_workdirs
from jaild.daemon.jails.launch.zygotes import ZygoteSet
from jaild.daemon.jails.pool import JailPool, TenantPools
from jaild.daemon.jails.staging import ensure_traversable, locate_nsjail, stage_runtime
from jaild.daemon.observe.metrics import Metrics
from jaild.daemon.placement import new_job_id, pool_spec
from jaild.daemon.selftest import (
    INSPECT_TOOL,
    Check,
    evaluate,
    host_paths_to_hide,
    privilege_checks,
    probe_code,
    uid_block_check,
)
from jaild.daemon.uidblock import UidBlockClaim, claim_uid_block
from jaild.errors import (
    CgroupError,
    DaemonUnavailable,
    JaildError,
    PolicyError,
    StartupError,
    ZygoteError,
)
from jaild.policy.compile import JOB_UIDS, HostLayout, nsjail_config
from jaild.policy.schema import Policy, check_policy_files, policy_files, resolve_env
from jaild.policy.seccomp import build_spec
from jaild.protocol import encode_frame, pack, unpack
from jaild.protocol.connection import HANDSHAKE_FRAME_BYTES
from jaild.protocol.messages import Error, JobDescription, ToolSpec, encode
from jaild.runtime.harden import become_child_subreaper
from jaild.runtime.seccomp import bpf_program, forked_programs
from jaild.runtime.seccomp import digest as seccomp_digest
from jaild.version import __version__

log = logging.getLogger("jaild")

ZYGOTE_UIDS = 65536 - JOB_UIDS
"""Host uids for zygotes in a daemon's block (see JOB_UIDS)."""

ProtocolFactory = Callable[[], asyncio.Protocol]
"""A new client connection's protocol (the daemon's
:class:`~jaild.daemon.server.ServedConnection`)."""

Progress = Callable[[Phase, Collection[str]], None]
"""Told each phase of the start once the socket is served, with the policies it concerns
(the daemon's :class:`~jaild.daemon.core.readiness.Readiness`)."""


@dataclass
class Served:
    """What a started daemon serves with: made by :func:`start`, undone by :meth:`release`."""

    policies: dict[str, Policy] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # policy -> why not served
    probe_results: dict[str, list[Check]] = field(default_factory=dict)
    pools: dict[str, JailPool] = field(default_factory=dict)
    env: JailEnvironment | None = None
    swept: list[str] = field(default_factory=list)  # jobs an earlier run left, swept at start
    config_fds: list[int] = field(default_factory=list)
    socket_inode: tuple[int, int] | None = None  # set when we bound the socket: ours to remove
    server: asyncio.Server | None = None
    owns_cgroups: bool = True
    """The cgroup subtree is this daemon's, to sweep and remove at stop (False: jails made
    without cgroups, as :mod:`jaild.testing`'s are)."""
    uid_block: UidBlockClaim | None = None
    """This daemon's claim on its uid block (:mod:`jaild.daemon.uidblock`), held from start
    to the end of :meth:`release`."""

    def pool_summary(self, policy: Policy, jails: bool = False) -> dict[str, Any]:
        """The policy's jail-making mode and its warm pool's state (for ``jaild policies``).
        ``jails``: also the ids of the ready jails (root only: the ids their jobs will get)."""
        pool = self.pools.get(policy.name)
        summary: dict[str, Any] = {
            "mode": policy.pool.mode,
            "min": policy.pool.min,
            "max": policy.pool.max,
            "target": pool.total_target if pool else 0,
            "ready": pool.size if pool else 0,
        }
        if pool is not None:  # every uid's pool of the policy, together
            summary.update(dataclasses.asdict(pool.total_stats()))
            if jails:
                summary["jails"] = pool.ready_ids()
        return summary

    def pool_summaries(self) -> dict[str, dict[str, Any]]:
        """Every pool's summary, by policy name."""
        return {n: self.pool_summary(p) for n, p in self.policies.items() if n in self.pools}

    def stop_zygotes(self) -> None:
        if self.env is not None:
            self.env.zygotes.stop_all()

    def release(self, config: DaemonConfig) -> None:
        """At stop: remove our socket, and the cgroup subtree with whatever a job left
        (only ours: we held the socket), close the sealed configs."""
        if self.socket_inode is not None:
            with contextlib.suppress(OSError):
                st = os.stat(config.socket_path)
                if (st.st_dev, st.st_ino) == self.socket_inode:
                    os.unlink(config.socket_path)
        if self.env is not None:
            self.env.audit.close()
            if self.owns_cgroups:
                self.env.cgroups.sweep()
                self.env.cgroups.remove_subtree()
        if self.uid_block is not None:  # last: no jail of ours runs as its uids any more
            self.uid_block.release()
        for fd in self.config_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.config_fds.clear()


def load_policies(config: DaemonConfig) -> dict[str, Policy]:
    """Every policy of ``policies_dir``, checked against this host.

    Raises:
        StartupError: listing every problem of every file (a file that does not load
            included: its own, and its env's).
        PolicyError: the directory itself (it does not exist, or holds no policy).
    """
    policies, problems = check_policy_files(policy_files(config.policies_dir), config.envs_dir)
    if problems:  # every file's, the host's too: all of them in one start
        raise StartupError("invalid policies:\n  " + "\n  ".join(p.message for p in problems))
    return policies


async def start(
    config: DaemonConfig,
    served: Served,
    metrics: Metrics,
    on_tool_call: ToolObserver,
    protocol: ProtocolFactory,
    only_policies: set[str] | None = None,
    on_egress: EgressObserver = lambda *_: None,
    progress: Progress = lambda *_: None,
) -> None:
    """Steps 1-7 of the module docstring; ``only_policies``: a private daemon's;
    ``progress``: told each phase once the socket is served.

    Raises:
        StartupError: why the daemon cannot start.
    """
    try:
        served.policies = load_policies(config)
    except PolicyError as exc:  # the directory itself (the files' problems: StartupError)
        raise StartupError(
            f"cannot load policies: {exc.message} (set daemon.policies_dir in the config "
            "file, --policies or JAILD_POLICIES)"
        ) from None
    sock = listening_socket(config, served)
    try:
        ids = uid_block_check(config.uid_base)  # whoever waits on the socket is told why
        if not ids.ok:
            raise StartupError(f"the jails' {ids.detail}: {ids.fix}")
        lacking = [c for c in privilege_checks() if not c.ok]  # fail closed (a container's)
        if lacking:
            raise StartupError(
                "jails cannot be made here (`jaild doctor` says the same): "
                + "; ".join(f"{c.name}: {c.detail}" for c in lacking)
                + f". Fix: {lacking[0].fix}"
            )
        served.uid_block = claim_uid_block(config.uid_base, config.socket_path)
        metrics.start(served.pool_summaries)
        try:
            cgroups = Cgroups(detect(config.subtree))
            cgroups.prepare()  # v2: finds the cgroup the daemon owns and moves in
            cgroups.limit_memory(config.memory_ceiling_mb)  # every jail's memory, together
        except CgroupError as exc:
            raise StartupError(str(exc)) from None
        if cgroups.placement is not None:
            log.info(
                "cgroup v2: %s; job cgroups in %s",
                cgroups.placement.detail,
                cgroups.subtree_dirs()[0],
            )
        try:
            served.server = await asyncio.get_running_loop().create_unix_server(protocol, sock=sock)
            await _start_jails(config, served, cgroups, on_tool_call, only_policies, on_egress,
                               progress)
        except BaseException:
            # We hold the socket, so the subtree is ours: a failed start leaves none of it.
            pools, served.pools = list(served.pools.values()), {}
            await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)
            served.stop_zygotes()
            cgroups.sweep()
            cgroups.remove_subtree()
            raise
    except BaseException as exc:
        metrics.stop()
        if served.uid_block is not None:  # a failed start gives its block up at once
            served.uid_block.release()
        if isinstance(exc, (StartupError, JaildError)):  # those never accepted: the backlog
            answer_waiting(sock, config.socket_path, exc.message)
        if served.server is not None:  # those accepted: the daemon tells them
            served.server.close()
        sock.close()
        raise
    where = config.socket_path if served.socket_inode else f"{sock.getsockname()} (activated)"
    layout = cgroups.layout
    log.info(
        "jaild %s serving %d policies (%s) on %s; nsjail %s; cgroup v%d subtree %s; %s",
        __version__,
        len(served.policies),
        ", ".join(sorted(served.policies)),
        where,
        served.env.nsjail if served.env else "?",
        layout.version,
        layout.subtree,
        loops.name(asyncio.get_running_loop()),
    )


async def _start_jails(
    config: DaemonConfig,
    served: Served,
    cgroups: Cgroups,
    on_tool_call: ToolObserver,
    only_policies: set[str] | None,
    on_egress: EgressObserver,
    progress: Progress,
) -> None:
    """Steps 4-6: the environment every jail shares, then zygotes, self-tests, pools."""
    served.swept = cgroups.sweep()
    if served.swept:
        log.warning(
            "swept %d job(s) left by an earlier run (killed their processes, removed their "
            "cgroups): %s",
            len(served.swept),
            " ".join(served.swept[:20]),
        )
    sweep_workdirs(range(config.uid_base, config.uid_base + 65536))
    nsjail = locate_nsjail(config.nsjail)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise StartupError(
            "setpriv (util-linux) is missing: jaild uses it to give every nsjail a "
            "parent-death signal, so no jail outlives the daemon. apt-get install util-linux"
        )
    log.debug("nsjail runs as its namespace's owner uid with capabilities %s", owner_caps())
    become_child_subreaper()
    ensure_traversable(config.state_dir)
    interpreters = [
        os.path.join(resolve_env(p, config.envs_dir), "bin", "python3")
        for p in served.policies.values()
    ]
    runtime_dir, _ = await asyncio.gather(  # and jsonschema's first use, not a job's
        asyncio.to_thread(stage_runtime, config.state_dir, interpreters),
        asyncio.to_thread(admission.prepare_schema_checks),
    )
    egress = await asyncio.to_thread(
        EgressService.prepare, served.policies, config.state_dir, on_egress,
        secrets_file=config.egress_secrets, upstream_ca=config.egress_upstream_ca,
    )
    host = HostLayout(
        runtime_dir=runtime_dir,
        envs_dir=config.envs_dir,
        cgroup=cgroups.layout,
        egress_trust=egress.trust_path if egress is not None else "",
        certifi=certifi_bundles(served.policies, config.envs_dir) if egress is not None else (),
        clone_into_cgroup=config.clone_into_cgroup and cgroups.layout.version == 2,
    )
    config_fds = {}
    specs = {}
    for name, policy in served.policies.items():
        fd = _sealed_memfd(f"jaild-{name}", nsjail_config(policy, host))
        served.config_fds.append(fd)
        config_fds[name] = fd
        specs[name] = build_spec(policy.seccomp_choice, network=policy.network.mode != "none")
    served.env = JailEnvironment(
        nsjail=nsjail,
        host=host,
        cgroups=cgroups,
        config_fds=config_fds,
        seccomp_specs=specs,
        seccomp_digests={
            name: _seccomp_digests(spec, served.policies[name], config)
            for name, spec in specs.items()
        },
        audit=KernelAuditLog(),
        on_tool_call=on_tool_call,
        uid_base=config.uid_base,
        launcher=(setpriv, "--pdeathsig", "TERM", "--"),
        kill_grace_s=config.kill_grace_s,
        egress=egress,
    )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if only_policies is not None:
        served.unavailable.update(
            {
                n: "not started in this private daemon"
                for n in served.policies
                if n not in only_policies
            }
        )
    progress(Phase.ZYGOTES, [n for n, p in served.policies.items()
                             if p.pool.mode == "zygote" and n not in served.unavailable])
    await _start_zygotes(config, served, host, nsjail)
    if config.probe_policies:
        progress(Phase.SELF_TESTS, [n for n in served.policies if n not in served.unavailable])
        await probe_policies(config, served)
    _start_pools(served)


async def _start_zygotes(
    config: DaemonConfig, served: Served, host: HostLayout, nsjail: str
) -> None:
    """Start the daemon's own zygote of every served policy in zygote mode (the zygote
    set starts each client uid's later, see jaild.daemon.jails.launch.zygotes); a policy whose
    zygote does not come up is not served (its jails could not be made)."""
    env = served.env
    assert env is not None
    fds: dict[str, tuple[int, int]] = {}
    for index, (name, policy) in enumerate(sorted(served.policies.items())):
        if policy.pool.mode != "zygote" or name in served.unavailable:
            continue
        text = nsjail_config(policy, host, zygote=True, max_jobs=config.max_jobs)
        fd = _sealed_memfd(f"jaild-zygote-{name}", text)
        served.config_fds.append(fd)
        fds[name] = (fd, index)

    # Each zygote has a host uid of its own: the daemon's own zygotes the policy's index,
    # client uids' zygotes the next free slot after those (the block's last 536 uids).
    free_slots: list[int] = []
    next_slot = [len(served.policies)]

    def make(policy: Policy, tenant: Tenant | None) -> Zygote:
        fd, index = fds[policy.name]
        own = tenant is None or tenant == env.zygotes.own_uid
        if not own:
            index = free_slots.pop() if free_slots else next_slot[0]
            if index >= ZYGOTE_UIDS:
                raise ZygoteError(f"all {ZYGOTE_UIDS} zygote uids are in use")
            next_slot[0] = max(next_slot[0], index + 1)
        return Zygote(
            policy,
            nsjail,
            host,
            env.cgroups,
            fd,
            zygote_uid=config.uid_base + JOB_UIDS + index,
            uid_base=config.uid_base,
            launcher=env.launcher,
            harden=env.harden(policy),
            max_jobs=config.max_jobs,
            split_seccomp=config.zygote_seccomp == "split",
            label=f"zygote-{policy.name}" if own else (
                f"zygote-{policy.name}-u{tenant}" if isinstance(tenant, int)
                else f"zygote-{policy.name}-{tenant}"),
        )

    def release(zygote: Zygote) -> None:
        slot = zygote.uid - config.uid_base - JOB_UIDS
        if slot >= len(served.policies):
            free_slots.append(slot)

    env.zygotes = ZygoteSet(
        make,
        scope=config.zygote_scope,
        max_zygotes=config.max_zygotes,
        idle_s=config.zygote_idle_s,
        own_uid=os.getuid(),
        release=release,
    )
    names = sorted(fds)
    for name in names:
        env.zygotes.serve(served.policies[name])
    results = await asyncio.gather(
        *(env.zygotes.start(n) for n in names), return_exceptions=True
    )
    for name, outcome in zip(names, results, strict=True):
        if isinstance(outcome, BaseException):
            served.unavailable[name] = f"its zygote did not start: {outcome}"
            served.probe_results[name] = [
                Check("zygote", False, str(outcome), "see the zygote's log above")
            ]
            log.error("policy %s will not be served: %s", name, served.unavailable[name])
            env.zygotes.policies.pop(name, None)
    env.zygotes.run()


def _start_pools(served: Served) -> None:
    env = served.env
    assert env is not None
    zygotes = env.zygotes
    for name, policy in served.policies.items():
        # no warm jails for a policy no one may use (access.users = [])
        if policy.pool.max == 0 or name in served.unavailable or not policy.access.users:
            continue

        def make(tenant: Tenant | None, policy: Policy = policy) -> JailedJob:
            # named for the job that will take it: its cgroup cannot be renamed (v2)
            jail_id = new_job_id()
            return JailedJob(pool_spec(jail_id, policy, tenant), env, None, None,
                             jail_id=jail_id)

        if zygotes.scope == "uid" and name in zygotes.policies:  # a pool per client uid
            pools = TenantPools(policy, make, zygotes)
            zygotes.on_retire(pools.retire)
            served.pools[name] = pools
        else:
            served.pools[name] = JailPool(policy, functools.partial(make, None))
        served.pools[name].start()


def listening_socket(config: DaemonConfig, served: Served) -> socket.socket:
    """systemd's socket, or ours: bound with its final mode and group, a stale one
    replaced, a live one (another daemon) refused."""
    activated = systemd.listen_sockets()
    if activated:
        return activated[0]
    path = config.socket_path
    directory = os.path.dirname(os.path.abspath(path))
    gid = grp.getgrnam(config.socket_group).gr_gid if config.socket_group else -1
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750)
        if gid >= 0:
            os.chown(directory, -1, gid)  # group members must traverse the 0750 directory
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale, from a daemon that died
            log.warning("removed stale socket %s", path)
        else:
            raise StartupError(f"another daemon is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~config.socket_mode)
    try:
        sock.bind(path)  # created with the final mode: no chmod-after-bind window
    finally:
        os.umask(old_umask)
    if gid >= 0:
        os.chown(path, -1, gid)
    st = os.stat(path)
    served.socket_inode = (st.st_dev, st.st_ino)
    sock.listen(512)
    return sock


def cannot_start(path: str, reason: str, told: bool) -> str:
    """What a client of a daemon whose start failed reads: the reason (``told``: the
    client runs as the daemon's own uid), or, since it describes the host, where to find
    it."""
    if told:
        return f"the jaild daemon at {path} cannot start: {reason}"
    return (f"the jaild daemon at {path} cannot start; its log says why "
            "(journalctl -u jaild, or its stderr)")


def answer_waiting(sock: socket.socket, path: str, reason: str) -> int:
    """A start that failed after the socket was claimed: answer each connection waiting in
    its backlog -- a client that connected while the daemon was starting, or the one whose
    connection activated it -- with an Error frame saying why (``DaemonUnavailable``), so
    that it reads the reason instead of a reset connection. The daemon's own uid (root for
    the system daemon) reads the reason itself; any other uid is told where to find it, since
    the reason describes the host. Returns how many were answered.

    Non-blocking throughout: a frame this small fits an empty socket buffer, and what the
    client sent (its Hello) is read and dropped first, so that it can read the frame."""
    told = cannot_start(path, reason, told=True)
    withheld = cannot_start(path, reason, told=False)
    frames = {
        told: encode_frame(encode(Error(code=DaemonUnavailable.code, message=told[:65536])),
                           HANDSHAKE_FRAME_BYTES),
        withheld: encode_frame(encode(Error(code=DaemonUnavailable.code, message=withheld)),
                               HANDSHAKE_FRAME_BYTES),
    }
    answered = 0
    sock.setblocking(False)
    while answered < 1024:  # a backlog holds at most 512; never loop on a hostile flood
        try:
            conn, _ = sock.accept()
        except OSError:  # BlockingIOError: no one else is waiting
            break
        with conn:
            conn.setblocking(False)
            uid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
            with contextlib.suppress(OSError):
                conn.recv(HANDSHAKE_FRAME_BYTES)
            with contextlib.suppress(OSError):
                conn.send(frames[told if uid == os.geteuid() else withheld])
        answered += 1
    if answered:
        log.info("answered %d waiting connection(s) with the reason", answered)
    return answered


PROBE_JOB_PREFIX = "probe-"
"""The job ids of the daemon's own self-test jobs (never a client's: theirs are ``job-…``);
their tool calls are not users' activity (no audit record, no metrics)."""


async def probe_policies(config: DaemonConfig, served: Served) -> None:
    """Run the self-test of every policy; a policy that fails it is not served."""
    names = sorted(n for n in served.policies if n not in served.unavailable)
    results = await asyncio.gather(*(_probe(config, served, served.policies[n]) for n in names))
    served.probe_results.update(zip(names, results, strict=True))
    for name, checks in zip(names, results, strict=True):
        failed = [c for c in checks if not c.ok]
        if failed:
            served.unavailable[name] = "it failed its self-test at start: " + "; ".join(
                f"{c.name}: {c.detail}" for c in failed
            )
            log.error(
                "policy %s failed its self-test and will not be served: %s",
                name,
                served.unavailable[name],
            )
        else:
            log.info("policy %s passed its self-test (%d checks)", name, len(checks))


async def _probe(config: DaemonConfig, served: Served, policy: Policy) -> list[Check]:
    assert served.env is not None
    hidden = host_paths_to_hide(policy, config.socket_path, config.state_dir, config.policies_dir)
    spec = JobSpec(
        job_id=PROBE_JOB_PREFIX + secrets.token_hex(8),
        policy=policy,
        limits=dataclasses.replace(policy.limits, wall_time_s=min(policy.limits.wall_time_s, 20)),
        job=JobDescription(
            code=probe_code(policy, hidden),
            filename="<self-test>",
            tools=(ToolSpec(name=INSPECT_TOOL, description="the job seen from the host"),),
        ),
        tenant=served.env.zygotes.own_uid,  # the daemon's own job: in the daemon's zygote
    )

    def inspect(job_id: str, call_id: int, name: str, args: bytes, approval: bool) -> CallReply:
        reply = CallReply()
        reply.resolve(True, pack(job.host_view()))
        return reply

    job = JailedJob(spec, served.env, inspect, lambda *_: None)
    try:
        record = await job.run()
    except Exception as exc:  # a jaild bug: the policy is not proven, so not served
        log.exception("self-test of policy %s crashed", policy.name)
        return [Check("probe job", False, f"crashed: {exc}")]
    facts = unpack(job.result) if job.result is not None else None
    error = record.error.to_dict() if record.error is not None else None
    return evaluate(policy, record.status, error, facts, job.outside_uid)


def _seccomp_digests(spec: dict[str, Any], policy: Policy, config: DaemonConfig) -> frozenset[str]:
    """The digests a jail of ``policy`` may report (``JailReady``): of its filters loaded whole
    (nsjail per job, or a zygote-mode policy's jail while its zygote is down) and, in zygote
    mode with ``daemon.zygote_seccomp = "split"``, of its zygote's filters then its own
    (:func:`jaild.runtime.seccomp.forked_programs`; tests/unit/test_zygote_filter.py proves
    the two give every call the same verdict)."""
    whole = seccomp_digest(bpf_program(spec))
    if policy.pool.mode != "zygote" or config.zygote_seccomp != "split":
        return frozenset({whole})
    return frozenset({whole, seccomp_digest(forked_programs(spec))})


def _sealed_memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, text.encode())
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


__all__ = ["Served", "StartupError", "listening_socket", "load_policies", "probe_policies", "start"]
