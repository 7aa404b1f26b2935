"""Policy files: schema, loading and validation.

A policy is a TOML file ``<name>.toml``. Every key is declared below with its
type, default, unit (in the name: ``memory_mb``, ``wall_time_s``) and a
one-line description; the policy reference in docs/running/policies.md is generated
from these declarations (``jaild policy reference``). Loading is strict: unknown keys,
wrong types, impossible values and unknown syscalls are errors of the form
``file: key.path: reason``, and the daemon refuses to start on any of them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import grp
import os
import pwd
import re
import tomllib
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaild.errors import EgressRuleError, PolicyError, SyscallNameError
from jaild.policy.egress import DEFAULT_PORTS, EgressRules, Rule, parse_host
from jaild.policy.flow import (
    FlowPlan,
    FlowRules,
    FlowSink,
    FlowSource,
    OnUntrusted,
    check_labels,
    compile_flow,
    parse_plan,
    parse_sink,
    parse_source,
)
from jaild.policy.seccomp import ACTIONS, SeccompChoice, allowed_syscalls
from jaild.policy.syscalls import PROFILES
from jaild.protocol.messages import MAX_CODE_CHARS, MAX_PAYLOAD_BYTES, POLICY_NAME

JAIL_ROOT = "/opt/jaild"
EGRESS_DOOR_PORT = 3128
"""Where an egress jail's gateway door listens, on the jail's own loopback
(:data:`jaild.policy.compile.EGRESS_PORT` is this)."""
RESERVED_PATHS = ("/tmp", "/proc", "/dev", JAIL_ROOT, "/")

_Validator = Callable[[Any], str | None]


def setting(default: Any, doc: str, check: _Validator | None = None) -> Any:
    """Declare a policy key: its default, a one-line description, and an extra check."""
    if isinstance(default, (list, tuple)):
        return dataclasses.field(
            default_factory=lambda: tuple(default), metadata={"doc": doc, "check": check}
        )
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def between(lo: float, hi: float) -> _Validator:
    def show(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else str(x)

    def check(v: Any) -> str | None:
        return None if lo <= v <= hi else f"must be between {show(lo)} and {show(hi)}, got {v!r}"

    return check


def choice(*values: str) -> _Validator:
    def check(v: Any) -> str | None:
        return None if v in values else f"must be one of {', '.join(values)}; got {v!r}"

    return check


@dataclass(frozen=True)
class Bind:
    src: str
    dst: str


JAIL_LEVEL_LIMITS = ("memory_mb", "pids", "cpu_cores", "file_size_mb", "open_files")
"""``[limits]`` a jail is made with (its cgroup and rlimits), fixed for its whole life: a
session's runs cannot change them, and a pooled jail serves only jobs that have the
policy's own. ``cpu_time_s`` is not among them: it is per run. A one-shot jail takes it as
its RLIMIT_CPU when made (so a pooled jail also needs the policy's own, see
``ONE_SHOT_JAIL_LIMITS``); a session's jail has the session's ``session.cpu_time_s`` as its
RLIMIT_CPU and the daemon holds each run to its own ``cpu_time_s`` (its cgroup's CPU time)."""

ONE_SHOT_JAIL_LIMITS = (*JAIL_LEVEL_LIMITS, "cpu_time_s")
"""What a jail made ahead of a single job (a warm pool's) fixes: also its RLIMIT_CPU."""


@dataclass(frozen=True)
class Limits:
    """``[limits]`` -- what one job may consume. Clients may ask for less per job, never more."""

    wall_time_s: float = setting(
        30.0,
        "Wall-clock time from code start; enforced by the daemon to ~100 ms.",
        between(0.01, 86400),
    )
    cpu_time_s: int = setting(30, "CPU seconds per process (RLIMIT_CPU).", between(1, 86400))
    memory_mb: int = setting(
        256, "Memory of the whole jail (cgroup, swap off); tmpfs counts.", between(16, 1 << 20)
    )
    pids: int = setting(64, "Processes and threads in the jail (pids cgroup).", between(4, 1 << 16))
    output_bytes: int = setting(
        1 << 20, "stdout+stderr cap; output is cut there and the job stopped.", between(0, 1 << 30)
    )
    file_size_mb: int = setting(
        16, "Largest file the job may write (RLIMIT_FSIZE).", between(1, 1 << 20)
    )
    open_files: int = setting(
        256, "Open file descriptors per process (RLIMIT_NOFILE).", between(16, 1 << 20)
    )
    cpu_cores: float = setting(
        0.0, "CPU bandwidth in cores (cgroup cpu); 0 = no cap.", between(0, 1024)
    )
    code_bytes: int = setting(
        256 * 1024, "Largest source a job may submit.", between(1, MAX_CODE_CHARS)
    )
    tool_payload_bytes: int = setting(
        1 << 20,
        "Largest packed arguments or result of one tool call.",
        between(64, MAX_PAYLOAD_BYTES),
    )
    result_bytes: int = setting(
        1 << 20, "Largest packed job result.", between(64, MAX_PAYLOAD_BYTES)
    )
    tool_call_timeout_s: float = setting(
        60.0,
        "A tool call must be answered within this, or the jail gets a timeout error.",
        between(0.01, 86400),
    )
    tool_calls_in_flight: int = setting(
        64, "Tool calls one job may have in flight at once.", between(1, 4096)
    )
    tool_calls: int = setting(
        10_000,
        "Tool calls one job (one session run) may make in all, refused ones included.",
        between(1, 1 << 30),
    )
    tool_bytes: int = setting(
        256 << 20,
        "Packed tool arguments and results one job may move in all.",
        between(64, 1 << 40),
    )
    slow_client: str = setting(
        "pause",
        "When the client reads output slower than the job writes it: \"pause\" the job's "
        "output (the job blocks on write) or \"truncate\" the live stream (the record keeps it).",
        choice("pause", "truncate"),
    )


@dataclass(frozen=True)
class Filesystem:
    """``[filesystem]`` -- what the jail sees. The root is an empty read-only tmpfs."""

    binds: tuple[Bind, ...] = setting(
        (Bind("/usr", "/usr"),), 'Host paths bound read-only: "/path" or {src, dst}.'
    )
    tmp_mb: int = setting(
        64, "Size of the writable tmpfs at /tmp (the working directory).", between(1, 1 << 16)
    )
    shm_mb: int = setting(
        16,
        "Size of a private tmpfs at /dev/shm (POSIX semaphores, multiprocessing); 0 = none.",
        between(0, 1 << 16),
    )
    proc: str = setting(
        "pid-only",
        '/proc: "pid-only" (subset=pid), "full", or "none".',
        choice("pid-only", "full", "none"),
    )


@dataclass(frozen=True)
class Network:
    """``[network]``."""

    mode: str = setting(
        "none",
        '"none": private netns, no interfaces, and AF_INET/AF_INET6 sockets and name lookups '
        "fail with PermissionError (EACCES) naming the policy, not a kill; "
        '"loopback": lo up, AF_INET allowed; "host": host network (unsafe); "egress": lo '
        "only, and HTTP(S) to the names of [egress] through the daemon's gateway.",
        choice("none", "loopback", "host", "egress"),
    )
    namespace: str = setting(
        "jail",
        '"jail": every jail gets a network namespace of its own; "tenant": the concurrent '
        "zygote jails of one tenant under this policy share one (faster to make: ~0.9 ms of "
        "kernel time less per jail), and so share its abstract Unix sockets and loopback; "
        'mode "none" or "loopback" and pool.mode "zygote" only.',
        choice("jail", "tenant"),
    )


@dataclass(frozen=True)
class Injection:
    """One ``[[egress.inject]]`` table: a header the gateway adds to requests for ``host``."""

    host: str
    header: str
    value_env: str


HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
NOT_INJECTABLE = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te",
    "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "proxy-connection",
    "expect",
})
"""Headers that frame or route a request (or are the proxy's own): never injected."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


def _egress_allow(entries: tuple[str, ...]) -> str | None:
    for i, entry in enumerate(entries):
        try:
            Rule.parse(entry)
        except EgressRuleError as exc:
            return f"entry {i}: {exc}"
    return None


def _ports(ports: tuple[int, ...]) -> str | None:
    bad = [p for p in ports if not 1 <= p <= 65535]
    if bad:
        return f"ports must be from 1 to 65535, got {bad[0]}"
    return None if ports else "must list at least one port"


@dataclass(frozen=True)
class Egress:
    """``[egress]`` -- with ``network.mode = "egress"``: what a job may reach by name, through
    the daemon's HTTP(S) gateway (the jail itself has only loopback)."""

    allow: tuple[str, ...] = setting(
        (),
        'Names a job may reach: "api.github.com", "*.example.com" (names below it), '
        '"pypi.org:443" (that port only), or an address literal.',
        _egress_allow,
    )
    ports: tuple[int, ...] = setting(
        DEFAULT_PORTS, "Ports an allow entry without its own port may reach.", _ports
    )
    deny_private: bool = setting(
        True,
        "Refuse every address that is not public unicast (loopback, RFC 1918, link-local "
        "and the metadata service, ULA, ...), checked after resolution.",
    )
    max_requests: int = setting(
        200, "Requests (and CONNECT tunnels) per job, refused ones included.", between(0, 1 << 24)
    )
    max_bytes: int = setting(
        100 << 20, "Bytes per job through the gateway, both directions.", between(0, 1 << 42)
    )
    inject: tuple[Injection, ...] = setting(
        (),
        "[[egress.inject]] tables {host, header, value_env}: a header the gateway adds for "
        "host (HTTPS intercepted with the daemon's CA); the value comes from the daemon's "
        "secrets file or environment and never enters the jail.",
    )


@functools.lru_cache(maxsize=64)
def egress_rules(egress: Egress) -> EgressRules:
    """``egress`` as the gateway's rules (validated when the policy loaded)."""
    return EgressRules.parse(egress.allow, egress.ports, egress.deny_private)


@dataclass(frozen=True)
class Seccomp:
    """``[seccomp]`` -- the syscall allow-list loaded in the jail before user code."""

    profile: str = setting(
        "default",
        "Built-in allow-list: " + ", ".join(f'"{p}"' for p in PROFILES) + ".",
        choice(*PROFILES),
    )
    action: str = setting(
        "kill",
        'On a disallowed syscall: "kill" (status policy_violation) or "errno" (EPERM). '
        'A network attempt under network.mode = "none" is never a kill (EACCES).',
        choice(*ACTIONS),
    )
    allow: tuple[str, ...] = setting((), "Extra syscalls or @groups to allow.")
    deny: tuple[str, ...] = setting((), "Syscalls or @groups to remove from the profile.")


@dataclass(frozen=True)
class Python:
    """``[python]``."""

    env: str = setting(
        "default",
        "Jail Python environment: a name under the envs directory, or an absolute path to a venv.",
    )


@dataclass(frozen=True)
class Access:
    """``[access]`` -- who and what may use this policy."""

    tools: tuple[str, ...] = setting(("*",), "Glob patterns of tool names jobs may register.")
    users: tuple[str, ...] = setting(("*",), 'Who may run jobs: "*", user names, uids, "@group".')
    approve: tuple[str, ...] = setting(
        (), "Glob patterns of tools whose every call needs the client's approval callback."
    )
    namespaces: tuple[str, ...] = setting(
        ("*",),
        "Glob patterns of the Kubernetes namespaces whose pods may run jobs, where pods are "
        'the tenants (daemon `access.identity = "kubernetes"`); clients outside pods are '
        "not in any and are judged by `users` alone.",
    )
    service_accounts: tuple[str, ...] = setting(
        ("*",),
        'Glob patterns of "namespace/name" of the service accounts whose pods may run jobs '
        '(e.g. "agents/*"), where pods are the tenants.',
    )
    principals: tuple[str, ...] = setting(
        ("*",),
        "Glob patterns of the principals network clients may run jobs as: what their "
        'verified certificate names (its URI SAN, e.g. "spiffe://example.org/agents/*", '
        'else its subject, e.g. "CN=ci,O=example"). `users` does not apply to them: a '
        "policy that narrows `users` should narrow this too.",
    )


def _module_names(names: tuple[str, ...]) -> str | None:
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
            return f"{name!r} is not a module name"
    return None


@dataclass(frozen=True)
class Pool:
    """``[pool]`` -- how jails are made, and how many wait ready ahead of jobs."""

    mode: str = setting(
        "zygote",
        '"zygote": each jail is forked from a per-policy template process and enters its '
        'own fresh namespaces; "spawn": a full nsjail per jail.',
        choice("zygote", "spawn"),
    )
    min: int = setting(0, "Hardened jails kept waiting for jobs, at least.", between(0, 256))
    max: int = setting(
        4,
        "At most this many waiting jails; the pool grows toward it under demand.",
        between(0, 256),
    )
    idle_s: float = setting(
        60.0,
        "A waiting jail unused this long is recycled (and the pool shrinks toward min).",
        between(0.1, 86400),
    )
    preimport: tuple[str, ...] = setting(
        (),
        "Modules imported once in the zygote (trusted, before hardening) so jobs get them free.",
        _module_names,
    )


@dataclass(frozen=True)
class Session:
    """``[session]`` -- jails kept for a series of runs that share their state."""

    enabled: bool = setting(True, "Whether clients may open sessions with this policy.")
    idle_s: float = setting(
        300.0, "A session with no run for this long is closed.", between(1, 7 * 86400)
    )
    max_lifetime_s: float = setting(
        3600.0,
        "A session is closed this long after it opened, busy or not.",
        between(1, 30 * 86400),
    )
    cpu_time_s: int = setting(
        600,
        "CPU seconds per process over the whole session (RLIMIT_CPU); each run also gets "
        "limits.cpu_time_s of the session's CPU.",
        between(1, 30 * 86400),
    )
    max_per_user: int = setting(16, "Sessions open at once per uid.", between(1, 4096))
    snapshots: bool = setting(
        True, "Whether sessions may be snapshotted, forked and paused (their state to disk)."
    )
    snapshot_max_mb: int = setting(
        32, "Largest snapshot (the pickled state and the working directory's files), MiB.",
        between(1, 60),
    )
    snapshot_ttl_s: float = setting(
        7 * 86400.0, "How long the daemon keeps a snapshot at most; a client may ask for less.",
        between(60, 90 * 86400),
    )
    pause_after_s: float = setting(
        0.0,
        "Pause a session to disk after this long without a run (its jail and memory are "
        "released; its next run restores it); 0: never. A client may ask for less.",
        between(0, 7 * 86400),
    )

    @property
    def snapshot_max_bytes(self) -> int:
        return self.snapshot_max_mb << 20


@dataclass(frozen=True)
class Files:
    """``[files]`` -- files uploaded into the working directory and collected after a run."""

    max_files: int = setting(256, "Files uploaded, or collected, per run.", between(1, 1 << 16))
    max_bytes: int = setting(
        16 << 20,
        "Total bytes uploaded, or downloaded, per run.",
        between(0, MAX_PAYLOAD_BYTES // 2),
    )
    max_depth: int = setting(16, "Directory levels below the working directory.", between(1, 64))
    max_name_chars: int = setting(
        255, "Longest file or directory name (UTF-8 bytes).", between(1, 255)
    )
    max_path_chars: int = setting(
        1024, "Longest relative path (UTF-8 bytes).", between(1, 4096)
    )


@dataclass(frozen=True)
class Approvals:
    """``[approvals]`` -- tool calls that need approval (``access.approve``, or tools marked
    ``approval``), decided by the daemon's approvers and able to wait for hours."""

    park_after_s: float = setting(
        0.0,
        "A run whose call has waited this long for approval is parked: its jail ends (a "
        "session's run: its session with it), it waits on disk (through daemon restarts) "
        "and goes on from that call once decided. 0: off -- the client's approve callback "
        "decides, as the call waits.",
        between(0, 7 * 86400),
    )
    approvers: tuple[str, ...] = setting(
        (),
        'Who may decide calls (ApproveCall, `jaild approve`): "*", user names, uids, "@group", '
        '"principal:NAME" (a network client), "pod:NAMESPACE/NAME" and '
        '"serviceaccount:NAMESPACE/NAME" (pods, globs: a pod is never matched by a uid or a '
        'group, which it chooses itself), "owner" (the run\'s own). Empty: the run\'s '
        "owner only. Root always may.",
    )
    max_wait_s: float = setting(
        7 * 86400.0,
        "A parked run not decided and continued within this long (from when it was parked) "
        "is dropped.",
        between(60, 90 * 86400),
    )


def _labels(labels: tuple[str, ...]) -> str | None:
    return check_labels(labels, "labels")


@dataclass(frozen=True)
class Flow:
    """``[flow]`` -- information-flow control: labels on tool results, and what a job may
    still send once it holds one (docs/using/flow.md)."""

    source: tuple[FlowSource, ...] = setting(
        (),
        "[[flow.source]] tables {tool, labels}: every result of tool (a glob) carries the "
        "labels; a job holding a label keeps it (a session: across its runs).",
    )
    sink: tuple[FlowSink, ...] = setting(
        (),
        "[[flow.sink]] tables {label, egress, deny_tools, approve_tools, result, output, "
        "downloads, release_to}: what stays open once a job holds label -- egress: the hosts "
        "still reachable (absent: unchanged, []: none); deny_tools / approve_tools: tools "
        'refused / needing approval ("*": all); result, output, downloads: "allow" or '
        '"withhold", and for result and output "redact" (the labelled values replaced; '
        'withheld when redaction cannot finish) -- unless the caller is in release_to: '
        'users, uids, "@group", "principal:NAME", "pod:NAMESPACE/NAME", '
        '"serviceaccount:NAMESPACE/NAME" (pods: never by uid or group).',
    )
    untrusted: tuple[str, ...] = setting(
        ("untrusted",), "Labels that mark untrusted data (web content, mail from others).",
        _labels,
    )
    protect: tuple[str, ...] = setting(
        (),
        "Tools (globs) whose arguments must not depend on untrusted data: once a job holds "
        "a label of flow.untrusted, their calls are refused or need approval (on_untrusted).",
    )
    on_untrusted: str = setting(
        "refuse", 'A protected tool called by a job holding untrusted data: "refuse" or '
        '"approve".', choice(*OnUntrusted),
    )
    plan: tuple[FlowPlan, ...] = setting(
        (),
        "[[flow.plan]] tables {tool, free}: a protected tool (a glob) that a job holding "
        "untrusted data may still call, once per intent it declared before it held any "
        "(tools.intend(tool, **values)), with every argument as the intent pinned it (one "
        "it did not name: absent) -- except the free ones, which may follow the data.",
    )


@functools.lru_cache(maxsize=64)
def flow_rules(policy: Policy) -> FlowRules:
    """``policy``'s ``[flow]``, compiled (validated when the policy loaded)."""
    f = policy.flow
    return compile_flow(policy.name, f.source, f.sink, f.untrusted, f.protect, f.on_untrusted,
                        f.plan)


SECTIONS: dict[str, type] = {
    "limits": Limits,
    "filesystem": Filesystem,
    "network": Network,
    "egress": Egress,
    "seccomp": Seccomp,
    "python": Python,
    "access": Access,
    "pool": Pool,
    "session": Session,
    "files": Files,
    "approvals": Approvals,
    "flow": Flow,
}


@dataclass(frozen=True)
class Policy:
    name: str
    path: str
    description: str
    limits: Limits
    filesystem: Filesystem
    network: Network
    egress: Egress
    seccomp: Seccomp
    python: Python
    access: Access
    pool: Pool
    session: Session
    files: Files
    approvals: Approvals
    flow: Flow

    @property
    def seccomp_choice(self) -> SeccompChoice:
        s = self.seccomp
        return SeccompChoice(s.profile, s.action, s.allow, s.deny)

    def summary(self) -> dict[str, Any]:
        """What ``jaild policies`` shows."""
        return {
            "name": self.name,
            "description": self.description,
            "limits": dataclasses.asdict(self.limits),
            "network": self.network.mode,
            "egress": list(self.egress.allow) if self.network.mode == "egress" else [],
            "seccomp": {"profile": self.seccomp.profile, "action": self.seccomp.action},
            "env": self.python.env,
            "flow": [line[:1024] for line in flow_rules(self).describe()][:256],
        }

    def tool_allowed(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.access.tools)

    def needs_approval(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.access.approve)

    def user_allowed(self, uid: int, gids: typing.Iterable[int]) -> bool:
        return user_matches(self.access.users, uid, gids)

    def principal_allowed(self, name: str) -> bool:
        """May a network client whose certificate names ``name`` use this policy?"""
        return principal_matches(self.access.principals, name)

    def pod_allowed(self, namespace: str, service_account: str) -> bool:
        """May a pod of ``namespace`` running as ``service_account`` use this policy?"""
        account = f"{namespace}/{service_account}"
        return any(fnmatch.fnmatchcase(namespace, p) for p in self.access.namespaces) and any(
            fnmatch.fnmatchcase(account, p) for p in self.access.service_accounts
        )


def principal_matches(patterns: typing.Iterable[str], name: str) -> bool:
    """Does a certificate's principal match one of the glob ``patterns``?"""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def user_matches(entries: typing.Iterable[str], uid: int, gids: typing.Iterable[int]) -> bool:
    """Does a peer (uid, gids) match an access list of "*", user names, uids and "@group"?"""
    gid_set = set(gids)
    for entry in entries:
        if entry == "*":
            return True
        if entry.startswith("@"):
            try:
                group = grp.getgrnam(entry[1:])
            except KeyError:
                continue
            if group.gr_gid in gid_set:
                return True
            try:
                if pwd.getpwuid(uid).pw_name in group.gr_mem:
                    return True
            except KeyError:
                pass
        elif entry.isdigit():
            if int(entry) == uid:
                return True
        else:
            try:
                if pwd.getpwnam(entry).pw_uid == uid:
                    return True
            except KeyError:
                continue
    return False


# --------------------------------------------------------------------------- loading


def type_label(tp: Any) -> str:
    """A short type name for reference tables: number, integer, string, boolean, list."""
    if tp is bool:
        return "boolean"
    return "list" if typing.get_origin(tp) is tuple else _type_name(tp).split()[-1]


def _type_name(tp: Any) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    return "a list"


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """(ok, value) -- strict TOML typing; integers are accepted where numbers are."""
    if tp is bool:
        return type(value) is bool, value
    if tp is int:
        return type(value) is int, value
    if tp is float:
        return type(value) in (int, float), float(value) if type(value) in (int, float) else value
    if tp is str:
        return type(value) is str, value
    return False, value


def load_section(
    path: str, section: str, cls: type, data: Any, errors: list[PolicyError] | None = None
) -> Any:
    """``[section]`` of a file as ``cls``. Raises the first PolicyError; with ``errors``,
    appends every one there instead and leaves each bad key at its default."""
    found = [] if errors is None else errors
    before = len(found)
    values = _section_values(path, section, cls, data, found)
    if errors is None and len(found) > before:
        raise found[before]
    return cls(**values)


def _section_values(
    path: str, section: str, cls: type, data: Any, errors: list[PolicyError]
) -> dict[str, Any]:
    if not isinstance(data, dict):
        errors.append(PolicyError(path, section, f"must be a table, got {type(data).__name__}"))
        return {}
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            errors.append(PolicyError(
                path, f"{section}.{key}", f"unknown key; [{section}] accepts {', '.join(known)}"
            ))
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            continue
        key = f"{section}.{name}"
        try:
            value = _value(path, key, hints[name], data[name])
            check = f.metadata.get("check")
            reason = check(value) if check is not None else None
            if reason:
                raise PolicyError(path, key, reason)
        except PolicyError as exc:
            errors.append(exc)
            continue
        values[name] = value
    return values


def _value(path: str, key: str, tp: Any, raw: Any) -> Any:
    """One key's value, typed (PolicyError if it is not of its type)."""
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(raw, list):
            raise PolicyError(path, key, f"must be a list, got {type(raw).__name__}")
        if item_tp is Bind:
            return tuple(_bind(path, f"{key}[{i}]", v) for i, v in enumerate(raw))
        if item_tp is Injection:
            return tuple(_injection(path, f"{key}[{i}]", v) for i, v in enumerate(raw))
        if item_tp in (FlowSource, FlowSink, FlowPlan):
            parse = {FlowSource: parse_source, FlowSink: parse_sink,
                     FlowPlan: parse_plan}[item_tp]
            out = []
            for i, v in enumerate(raw):
                try:
                    out.append(parse(v))
                except ValueError as exc:
                    where, _, why = str(exc).partition(": ")
                    if not why:
                        raise PolicyError(path, f"{key}[{i}]", where) from None
                    raise PolicyError(path, f"{key}[{i}].{where}", why) from None
            return tuple(out)
        want, name = (int, "an integer") if item_tp is int else (str, "a string")
        for i, item in enumerate(raw):
            if type(item) is not want:
                raise PolicyError(path, f"{key}[{i}]", f"must be {name}, got {item!r}")
        return tuple(raw)
    ok, value = _coerce(tp, raw)
    if not ok:
        raise PolicyError(path, key, f"must be {_type_name(tp)}, got {raw!r}")
    return value


def _bind(path: str, key: str, raw: Any) -> Bind:
    src: Any
    dst: Any
    if isinstance(raw, str):
        src = dst = raw
    elif isinstance(raw, dict) and set(raw) <= {"src", "dst"} and "src" in raw:
        src = raw["src"]
        dst = raw.get("dst", src)
    else:
        raise PolicyError(path, key, 'must be "/path" or {src = "/path", dst = "/path"}')
    for what, p in (("src", src), ("dst", dst)):
        if not isinstance(p, str) or not p.startswith("/"):
            raise PolicyError(path, f"{key}.{what}", f"must be an absolute path, got {p!r}")
        if os.path.normpath(p) != p or "/../" in p + "/":
            raise PolicyError(path, f"{key}.{what}", f"must be a normalised path, got {p!r}")
    for reserved in RESERVED_PATHS:
        if dst == reserved or (reserved != "/" and dst.startswith(reserved + "/")):
            raise PolicyError(path, f"{key}.dst", f"{dst} is reserved by jaild inside the jail")
    return Bind(src, dst)


def _injection(path: str, key: str, raw: Any) -> Injection:
    fields = ("host", "header", "value_env")
    if not isinstance(raw, dict):
        raise PolicyError(path, key, "must be a table {host, header, value_env}")
    for name in raw:
        if name not in fields:
            raise PolicyError(path, f"{key}.{name}", f"unknown key; accepts {', '.join(fields)}")
    for name in fields:
        if type(raw.get(name)) is not str:
            raise PolicyError(path, f"{key}.{name}", f"must be a string, got {raw.get(name)!r}")
    host, header, env = raw["host"].strip(), raw["header"], raw["value_env"]
    try:
        parsed = parse_host(host)
    except EgressRuleError as exc:
        raise PolicyError(path, f"{key}.host", str(exc)) from None
    if not HEADER_TOKEN.match(header):
        raise PolicyError(path, f"{key}.header", f"{header!r} is not an HTTP header name")
    if header.lower() in NOT_INJECTABLE:
        raise PolicyError(path, f"{key}.header", f"{header} frames or routes a request; "
                          "it cannot be injected")
    if not ENV_NAME.match(env):
        raise PolicyError(path, f"{key}.value_env", f"{env!r} is not a variable name")
    return Injection(str(parsed), header, env)


def _check_egress(policy: Policy, data: Mapping[str, Any]) -> None:
    """``[egress]`` belongs to ``network.mode = "egress"``, which needs something to reach;
    each injection's host is on the allow-list, once per header."""
    egress, path = policy.egress, policy.path
    if policy.network.mode != "egress":
        if "egress" in data:
            raise PolicyError(path, "egress", 'needs network.mode = "egress"')
        return
    if not egress.allow:
        raise PolicyError(path, "egress.allow", 'is empty: network.mode = "egress" would '
                          'reach nothing (use mode = "none")')
    rules = egress_rules(egress)
    seen: set[tuple[str, str]] = set()
    for i, inj in enumerate(egress.inject):
        key = f"egress.inject[{i}]"
        host = parse_host(inj.host)
        if not any(r.names(host) for r in rules.allow):
            raise PolicyError(path, f"{key}.host", f"{inj.host} is not on egress.allow")
        if (inj.host, inj.header.lower()) in seen:
            raise PolicyError(path, f"{key}.header", f"{inj.header} is injected for "
                              f"{inj.host} twice")
        seen.add((inj.host, inj.header.lower()))


def load_policy_text(text: str, path: str) -> Policy:
    """Parse and validate one policy. ``path`` names it in errors and gives its name.

    Raises:
        PolicyError: every problem of the file at once (``errors``; its message has one
            ``file: key: reason`` line each).
    """
    stem = Path(path).name.removesuffix(".toml")
    if not re.fullmatch(POLICY_NAME, stem):
        raise PolicyError(path, "", f"policy name {stem!r} must match {POLICY_NAME}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(path, "", f"not valid TOML: {exc}") from None
    errors: list[PolicyError] = []
    allowed = {"description", *SECTIONS}
    for key in data:
        if key not in allowed:
            errors.append(PolicyError(
                path, key, f"unknown key; a policy accepts {', '.join(sorted(allowed))}"
            ))
    description = data.get("description", "")
    if not isinstance(description, str):
        errors.append(PolicyError(path, "description", f"must be a string, got {description!r}"))
        description = ""
    sections = {
        name: load_section(path, name, cls, data.get(name, {}), errors)
        for name, cls in SECTIONS.items()
    }
    policy = Policy(name=stem, path=path, description=description, **sections)
    for check in (_check_network, _check_egress, _check_seccomp, _check_python, _check_pool,
                  _check_approvals, _check_flow):
        try:
            check(policy, data)
        except PolicyError as exc:
            errors.append(exc)
    if errors:
        raise PolicyError.every(errors)
    return policy


SHARED_NAMESPACE_MODES = ("none", "loopback")
"""The ``network.mode`` values whose jails may share a tenant's network namespace."""


def _check_network(policy: Policy, data: Mapping[str, Any]) -> None:
    """``network.namespace = "tenant"`` only where a jail has a namespace of its own to
    share, made by a zygote, holding nothing that is one jail's alone."""
    network, path = policy.network, policy.path
    if network.namespace != "tenant":
        return
    if network.mode == "host":
        raise PolicyError(path, "network.namespace", '"tenant" needs network.mode = "none" or '
                          '"loopback": with "host" a jail has no network namespace of its own '
                          "to share")
    if network.mode == "egress":
        raise PolicyError(path, "network.namespace", '"tenant" needs network.mode = "none" or '
                          '"loopback": an egress jail\'s gateway door listens on its own '
                          f"127.0.0.1:{EGRESS_DOOR_PORT} and serves that jail's run alone (its "
                          "allow-list, quotas and labels); jails sharing a namespace would "
                          "share one door")
    if policy.pool.mode != "zygote":
        raise PolicyError(path, "network.namespace", '"tenant" needs pool.mode = "zygote": a '
                          "spawned jail (an nsjail per job) always gets a network namespace "
                          "of its own")


def _check_pool(policy: Policy, data: Mapping[str, Any]) -> None:
    if policy.pool.min > policy.pool.max:
        raise PolicyError(
            policy.path, "pool.min",
            f"{policy.pool.min} is more than pool.max ({policy.pool.max})",
        )
    if policy.pool.mode == "spawn" and policy.pool.preimport:
        raise PolicyError(policy.path, "pool.preimport", 'needs mode = "zygote"')


def _check_approvals(policy: Policy, data: Mapping[str, Any]) -> None:
    park = policy.approvals.park_after_s
    if park and park >= policy.limits.wall_time_s:
        raise PolicyError(
            policy.path, "approvals.park_after_s",
            f"{park:g} s is not below limits.wall_time_s ({policy.limits.wall_time_s:g} s): a "
            "run waiting for approval would time out before it is parked",
        )


def _check_flow(policy: Policy, data: Mapping[str, Any]) -> None:
    """A sink's egress hosts are patterns the gateway reads, and a subset of what the policy
    reaches at all."""
    for i, sink in enumerate(policy.flow.sink):
        if not sink.egress:
            continue
        key = f"flow.sink[{i}].egress"
        if policy.network.mode != "egress":
            raise PolicyError(policy.path, key, 'needs network.mode = "egress"')
        why = _egress_allow(sink.egress)
        if why is not None:
            raise PolicyError(policy.path, key, why)


def _check_seccomp(policy: Policy, data: Mapping[str, Any]) -> None:
    try:
        allowed_syscalls(policy.seccomp_choice)
    except SyscallNameError as exc:
        key = "seccomp.allow"
        text = str(exc)
        for entry in policy.seccomp.deny:
            if repr(entry) in text:
                key = "seccomp.deny"
        raise PolicyError(policy.path, key, text) from None


def _check_python(policy: Policy, data: Mapping[str, Any]) -> None:
    problem = _env_problem(policy.python.env)
    if problem is not None:
        raise PolicyError(policy.path, "python.env", problem)


def _env_problem(env: str) -> str | None:
    """What is wrong with ``python.env = env`` as written (None: nothing)."""
    if env.startswith("/"):
        if os.path.normpath(env) != env:
            return f"must be a normalised path, got {env!r}"
    elif not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", env):
        return f"{env!r} is neither an env name nor an absolute path"
    return None


def load_policy(path: str | os.PathLike[str]) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(str(p), "", f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PolicyError(str(p), "", "not UTF-8 text") from None
    return load_policy_text(text, str(p))


def policy_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``*.toml`` files of ``directory``, in name order.

    Raises:
        PolicyError: naming the directory (no key): it does not exist, or has no policy.
    """
    d = Path(directory)
    if not d.is_dir():
        raise PolicyError(str(d), "", "policy directory does not exist")
    files = sorted(d.glob("*.toml"))
    if not files:
        raise PolicyError(str(d), "", "no *.toml policies in this directory")
    return files


def load_policy_dir(directory: str | os.PathLike[str]) -> dict[str, Policy]:
    """Load every ``*.toml`` of ``directory``.

    Raises:
        PolicyError: every problem of every file at once (``errors``; one ``file: key:
            reason`` line each), or the directory's own (:func:`policy_files`).
    """
    policies, problems = check_policy_files(policy_files(directory))
    if problems:
        raise PolicyError.every(problems)
    return policies


def check_policy_files(
    files: Iterable[str | os.PathLike[str]], envs_dir: str | None = None
) -> tuple[dict[str, Policy], list[PolicyError]]:
    """Load each file, and find every problem of every file in one pass: each file's own
    (all of them, :func:`load_policy_text`) and, with ``envs_dir``, the host's
    (:func:`host_checks`) -- for a file that does not load too, as far as its ``python.env``
    can be read: a missing env is named with the file's other problems, not after them.

    Returns:
        The policies that loaded, by name, and the problems in file order.
    """
    policies: dict[str, Policy] = {}
    problems: list[PolicyError] = []
    for file in files:
        try:
            policy = load_policy(file)
        except PolicyError as exc:
            problems.extend(exc.errors)
            if envs_dir is not None:
                problems.extend(_unloaded_env_checks(str(file), envs_dir))
            continue
        policies[policy.name] = policy
        if envs_dir is not None:
            problems.extend(host_checks(policy, envs_dir))
    return policies, problems


def _unloaded_env_checks(path: str, envs_dir: str) -> Iterator[PolicyError]:
    """:func:`env_checks` for a file that did not load, if its ``python.env`` is readable
    and well-formed (else the file's own errors say so already); whether the jail can see
    the env is left out, since its binds may be what failed."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return
    python = data.get("python", {})
    env = python.get("env", Python().env) if isinstance(python, dict) else None
    if isinstance(env, str) and _env_problem(env) is None:
        yield from env_checks(path, env, envs_dir)


def blocking_ancestor(path: str) -> str | None:
    """The first directory on ``path`` the jailed uid cannot search (nsjail binds as that uid)."""
    p = Path(path)
    for d in reversed([p, *p.parents]):
        try:
            if d.is_dir() and d.stat().st_mode & 0o001 == 0:
                return str(d)
        except OSError:
            return str(d)
    return None


def host_checks(policy: Policy, envs_dir: str) -> Iterator[PolicyError]:
    """Checks that need the host: bind sources exist, the Python env is usable in a jail."""
    for i, bind in enumerate(policy.filesystem.binds):
        key = f"filesystem.binds[{i}].src"
        if not os.path.exists(bind.src):
            yield PolicyError(policy.path, key, f"{bind.src} does not exist on this host")
        elif (blocked := blocking_ancestor(bind.src)) is not None:
            yield PolicyError(
                policy.path,
                key,
                f"{blocked} is not world-searchable; nsjail cannot bind {bind.src}",
            )
    yield from env_checks(policy.path, policy.python.env, envs_dir,
                          [b.src for b in policy.filesystem.binds])


def env_checks(path: str, name: str, envs_dir: str,
               binds: list[str] | None = None) -> Iterator[PolicyError]:
    """The checks of ``python.env = name`` (of the policy file ``path``) on this host: it
    exists, is a venv the jailed uid can read, and (``binds``: the policy's bind sources;
    None: not checked) its interpreter resolves to a path the jail sees."""
    env = name if name.startswith("/") else os.path.join(envs_dir, name)
    if os.path.isdir(env) and (blocked := blocking_ancestor(env)) is not None:
        yield PolicyError(
            path,
            "python.env",
            f"{blocked} is not world-searchable; nsjail cannot bind {env}",
        )
    python = os.path.join(env, "bin", "python3")
    if not os.path.isdir(env):
        yield PolicyError(
            path,
            "python.env",
            f"environment {env} does not exist; build it: jaild env build {name} "
            f"-r requirements.txt --state-dir {os.path.dirname(envs_dir)} "
            "(or point python.env at a venv)"
            if not name.startswith("/")
            else f"environment {env} does not exist; point python.env at a venv, or build "
            "one (jaild env build NAME -r requirements.txt) and set python.env = NAME",
        )
        return
    if not os.path.exists(python):
        yield PolicyError(path, "python.env", f"{python} does not exist; is {env} a venv?")
        return
    real = os.path.realpath(python)
    visible = [*binds, env] if binds is not None else None
    if visible is not None and not any(
        real == v or real.startswith(v.rstrip("/") + "/") for v in visible
    ):
        yield PolicyError(
            path,
            "python.env",
            f"{python} resolves to {real}, which the jail cannot see (not under any bind); "
            "rebuild the env from a system interpreter, e.g. /usr/bin/python3",
        )
    mode = os.stat(env).st_mode
    if mode & 0o005 != 0o005:
        yield PolicyError(
            path,
            "python.env",
            f"{env} is not world-readable (mode {oct(mode & 0o777)}); the jailed uid cannot use it",
        )


def resolve_env(policy: Policy, envs_dir: str) -> str:
    env = policy.python.env
    return env if env.startswith("/") else os.path.join(envs_dir, env)


def reference_markdown() -> str:
    """The policy reference table (docs/running/policies.md), generated from the declarations."""
    lines = [
        "| key | type | default | meaning |",
        "|---|---|---|---|",
        '| `description` | string | `""` | One line shown by `jaild policies`. |',
    ]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            tname = type_label(tp)
            if f.default is not dataclasses.MISSING:
                default: Any = f.default
            else:
                default = f.default_factory()  # type: ignore[operator]
            if isinstance(default, tuple):
                default = [b.src if isinstance(b, Bind) else b for b in default]
            if section == "egress" and f.name == "inject":
                section_key = "[[egress.inject]]"
                lines.append(f"| `{section_key}` | list | `[]` | {f.metadata['doc']} |")
                continue
            shown = toml_value(default)
            lines.append(f"| `{section}.{f.name}` | {tname} | `{shown}` | {f.metadata['doc']} |")
    return "\n".join(lines) + "\n"


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, float) and v.is_integer():
        return f"{v:.1f}"
    return str(v)


def effective_limits(policy: Policy, requested: Mapping[str, float]) -> Limits:
    """The policy's limits tightened by a job's request. Looser requests are refused.

    Raises ValueError with a message naming the limit, the request and the policy's value.
    A job that asks for nothing gets the policy's own ``Limits``, checked when it loaded.
    """
    if not requested:
        return policy.limits
    known = {f.name: f for f in dataclasses.fields(Limits)}
    changes: dict[str, Any] = {}
    for name, value in requested.items():
        if name not in known:
            raise ValueError(f"unknown limit {name!r}; limits are: {', '.join(known)}")
        current = getattr(policy.limits, name)
        if (
            type(value) not in (int, float)
            or value != value
            or (value <= 0 and name != "output_bytes")
        ):
            raise ValueError(f"limit {name}={value!r} must be a positive number")
        if name == "cpu_cores" and current == 0:
            changes[name] = float(value)
            continue
        if value > current:
            raise ValueError(
                f"limit {name}={value:g} is looser than policy {policy.name!r} allows "
                f"({current:g}); jobs may only tighten limits"
            )
        changes[name] = type(current)(value) if isinstance(current, int) else float(value)
    limits = dataclasses.replace(policy.limits, **changes)
    for name, f in known.items():
        check = f.metadata.get("check")
        reason = check(getattr(limits, name)) if check else None
        if reason:
            raise ValueError(f"limit {name}: {reason}")
    return limits
