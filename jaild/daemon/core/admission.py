"""Admission: may this request run, and on what terms? Pure: no IO, no asyncio.

Theory of operation
-------------------
Every request the daemon accepts passes here first, and nothing here touches a
socket, a jail or the clock. The inputs are values -- the request message, the
policies served (a :class:`Catalog`), the peer, and counts of what is running --
and the output is either the terms the request runs on or a typed refusal: a
:class:`~jaild.errors.JaildError` subclass whose ``code`` and message the client
gets as ``Error``. So every rule is tested without root (``tests/unit/test_admission.py``).

=====================  ==========================================  ====================
request                checks, in order (the first that fails)     result
=====================  ==========================================  ====================
a connection           peer allowed; connections; connections/uid  ``None``
``RunJob``             shutting down, draining, policy known,       :class:`AdmittedJob`
                       served, peer allowed, tools (unique,
                       allowed, schemas), code size, limits, uploads
``RunJob`` (session)   draining (the sessions' check); policy and  :class:`AdmittedJob`
                       tools are the session's, code size, limits,
                       jail-level limits unchanged, uploads
``OpenSession``        as ``RunJob``'s policy and tools; sessions   :class:`SessionTerms`
                       enabled; limits; idle and lifetime only
                       tighten; sessions per uid
capacity               jobs on the connection; the uid's jails (a    ``None``
                       pod's: its slot request, if any) and
                       memory; the daemon's jails and memory
=====================  ==========================================  ====================

The daemon never compiles a job's code: untrusted source goes through CPython's
compiler only in the jail, which reports a ``SyntaxError`` as the job's error like any
other. (Compiling it here would run a tenant's input through the compiler in the root
daemon, on the event loop every tenant shares: the largest code a policy accepts, 256 KiB
by default, took ~0.1 s to compile, and a job's code travels to the jail anyway.)

Capacity (:func:`check_capacity`) is where uids share the daemon. A *jail held* is a
one-shot job running or a session open (a session's run is its session's jail, not
another); its *memory* is its ``memory_mb`` limit. A uid may hold at most
``max_jobs_per_uid`` jails and ``max_memory_mb_per_uid`` of memory -- by default half
the daemon's -- so one uid flooding the daemon leaves the rest to everyone else. The
daemon as a whole holds at most ``max_jobs`` jails, and the memory limits of its jails
add up to at most ``max_memory_mb`` (the limit of its cgroup subtree, which bounds what
they really use) times ``memory_overcommit`` (a limit is a ceiling, not a use). A warm
pool's jail counts once a job takes it: until then it runs no user code and holds a few
MiB, not its limit (the subtree's kernel limit covers that). A request past any of these is
refused ``busy``, naming the limit; nothing waits in a queue.

A pod that requests jail slots (the extended resource ``access.slot_resource``, which a
device plugin advertises so that the scheduler places pods where slots are free and a
ResourceQuota caps a namespace's) holds at most that many jails, counted by its pod uid
(``Principal.slots``, ``Load.pod_jails``), in place of ``max_jobs_per_uid``: the scheduler
gave it those slots. Its memory share and the daemon's limits apply as to anyone. A pod
that requests none is held to ``max_jobs_per_uid`` as before.

Whether a peer may use a policy (``access.users``) can name users and groups,
which resolves through NSS: the :class:`Catalog` takes that test as a function
(``may_use``), so admission itself stays pure and tests need no users.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaild.daemon.core.peer import Peer, Principal, PrincipalKind
from jaild.errors import (
    BadRequest,
    Busy,
    PermissionDenied,
    PolicyUnavailable,
    ShuttingDown,
    UnknownPolicy,
)
from jaild.policy.compile import file_limits
from jaild.policy.schema import (
    JAIL_LEVEL_LIMITS,
    Limits,
    Policy,
    effective_limits,
    principal_matches,
    user_matches,
)
from jaild.protocol.fields import Struct, list_of, map_of, nested, number, string, struct
from jaild.protocol.fields import field as checked
from jaild.protocol.messages import MAX_TOOLS, JobDescription, OpenSession, RunJob, ToolSpec
from jaild.runtime.files import check_file_set

SCHEMA_MESSAGE_CHARS = 1024
"""A schema's problem is cut to this many characters in the refusal."""
SCHEMA_MEMO_SIZE = 4096
_schema_problems: dict[str, str | None] = {}  # a memo: JSON text of a schema -> its problem


def policy_allows(policy: Policy, peer: Peer) -> bool:
    """The policy's ``access.users`` admits the peer (its uid, gid or groups) and, for a
    pod, ``access.namespaces`` its namespace and ``access.service_accounts`` its service
    account; a network client, ``access.principals`` its certificate's principal."""
    who = peer.principal
    if who.kind is PrincipalKind.CERT:  # a network client: no uid, its certificate's principal
        return policy.principal_allowed(who.name)
    if not policy.user_allowed(peer.uid, (peer.gid, *peer.groups)):
        return False
    return (who.kind is not PrincipalKind.POD
            or policy.pod_allowed(who.namespace, who.service_account))


@dataclass(frozen=True)
class Catalog:
    """The policies a daemon serves, as admission sees them."""

    policies: Mapping[str, Policy]
    unavailable: Mapping[str, str] = field(default_factory=dict)  # name -> why not served
    stopping: bool = False  # the daemon is shutting down: no new work
    draining: float | None = None  # draining (SIGTERM, daemon.drain_s): the drain's length
    may_use: Callable[[Policy, Peer], bool] = policy_allows


@dataclass(frozen=True)
class AdmittedJob:
    """A run's terms: everything of its job spec but the id it gets when placed."""

    policy: Policy
    limits: Limits
    job: JobDescription  # the client's, whole (a session's run: with the session's tools)
    labels: frozenset[str] = frozenset()  # the caller's: held from the start (RunJob.labels)


@struct
class SessionAsked(Struct):
    """What a session was opened with beside its policy (``OpenSession``, admitted):
    declared once, and kept with a run of it that parks (the parked run's file), so that a
    session re-made for that run has the same terms (:func:`session_terms`)."""

    idle_s: float = checked(number(0, 1 << 53))
    max_lifetime_s: float = checked(number(0, 1 << 53))
    pause_after_s: float = checked(number(0, 1 << 53), default=0.0)  # 0: never when idle
    tools: tuple[ToolSpec, ...] = checked(list_of(nested(ToolSpec), MAX_TOOLS), default=())
    requested: dict[str, float] = checked(
        map_of(string(64, min_len=1), number(0, 1 << 53), 32), default_factory=dict)
    """The limits asked for at open (each run adds its own)."""


@dataclass(frozen=True)
class SessionTerms:
    """What a session is opened with (``OpenSession``, admitted): :func:`session_terms`."""

    policy: Policy
    asked: SessionAsked
    limits: Limits  # its runs' limits unless they tighten them
    jail_limits: Limits  # the jail's own: the session's CPU rlimit in place of a run's
    labels: frozenset[str] = frozenset()  # the caller's: held from the start (OpenSession.labels)

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        return self.asked.tools

    @property
    def requested(self) -> Mapping[str, float]:
        return self.asked.requested

    @property
    def idle_s(self) -> float:
        return self.asked.idle_s

    @property
    def max_lifetime_s(self) -> float:
        return self.asked.max_lifetime_s

    @property
    def pause_after_s(self) -> float:
        return self.asked.pause_after_s


def session_terms(policy: Policy, asked: SessionAsked,
                  labels: frozenset[str] = frozenset()) -> SessionTerms:
    """The one rule that makes a session's terms from its policy and what was asked: at
    ``OpenSession`` (:func:`admit_session`, which first refuses what is looser than the
    policy) and when a session is re-made for its parked run (where the policy may have
    been tightened since: each value is held to the policy's now).

    Raises:
        BadRequest: a requested limit the policy no longer allows.
    """
    session = policy.session
    pause_after_s = asked.pause_after_s
    if session.pause_after_s and pause_after_s > session.pause_after_s:
        pause_after_s = session.pause_after_s
    asked = dataclasses.replace(
        asked, idle_s=min(asked.idle_s, session.idle_s),
        max_lifetime_s=min(asked.max_lifetime_s, session.max_lifetime_s),
        pause_after_s=pause_after_s)
    limits = limits_for(policy, asked.requested)
    return SessionTerms(
        policy=policy, asked=asked, limits=limits,
        # the jail's CPU rlimit covers the session; each run's cpu_time_s is watched apart
        jail_limits=dataclasses.replace(limits, cpu_time_s=session.cpu_time_s),
        labels=labels)


# --------------------------------------------------------------------------- connections


def admit_connection(
    peer: Peer,
    others: Collection[Peer],
    *,
    allowed_users: Collection[str],
    max_connections: int,
    max_connections_per_uid: int,
    matches: Callable[[Collection[str], int, tuple[int, ...]], bool] = user_matches,
    allowed_principals: Collection[str] = ("*",),
) -> None:
    """May a new connection stay, beside ``others`` (the connections already open)?

    Raises:
        PermissionDenied: the peer is not in the daemon's ``allowed_users`` (a network
            client: its certificate's principal is not in ``allowed_principals``).
        Busy: the daemon, or the peer's uid, is at its connection limit.
    """
    if peer.principal.kind is PrincipalKind.CERT:
        if not principal_matches(allowed_principals, peer.principal.name):
            raise PermissionDenied(
                f"{peer.principal} may not use this daemon (access.principals)"
            )
    elif not matches(allowed_users, peer.uid, (peer.gid, *peer.groups)):
        raise PermissionDenied(f"{peer.principal} may not use this daemon")
    if len(others) >= max_connections:
        raise Busy(
            f"{len(others)} connections open, the daemon's limit "
            f"(limits.max_connections {max_connections}); retry later"
        )
    mine = sum(1 for other in others if other.principal.key == peer.principal.key)
    if mine >= max_connections_per_uid:
        raise Busy(
            f"{peer.principal.tenant} already has {mine} connections, the limit per "
            f"{peer.principal.kind} (limits.max_connections_per_uid {max_connections_per_uid})"
        )


@dataclass(frozen=True)
class Capacity:
    """The daemon's limits on what runs at once (config keys, derived defaults resolved)."""

    max_jobs: int
    max_jobs_per_connection: int
    max_jobs_per_uid: int
    max_memory_mb: int
    max_memory_mb_per_uid: int
    memory_overcommit: float = 1.0  # the limits may add up to this x max_memory_mb
    slot_resource: str = "jaild.dev/slots"  # access.slot_resource: named in a pod's refusal


@dataclass(frozen=True)
class Held:
    """What some party holds now: jails (one-shot jobs running, sessions open; a session's
    run is its session's jail, not another) and the sum of their memory limits, in MiB."""

    jails: int = 0
    memory_mb: int = 0


@dataclass(frozen=True)
class Load:
    """What is held when a request arrives."""

    daemon: Held  # everyone's jails
    uid: Held  # the requesting principal's (its uid's, or its pod's)
    on_connection: int | None = None  # jobs running on the connection (None: not limited)
    pod_jails: int = 0  # jails held by the requesting pod, by its pod uid (if it has slots)


def _mib(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb} MiB"


def check_capacity(who: Principal, load: Load, caps: Capacity, memory_mb: int) -> None:
    """Room for one more jail of ``memory_mb`` for ``who``? The rules, first to fail:
    the connection's jobs, the principal's jails, its memory, the daemon's jails, the
    daemon's memory (the jails' limits). A uid (or pod) at its share is refused; the
    rest of the daemon stays for the others. The ``*_per_uid`` limits are per principal:
    per pod where pods are the tenants (``access.identity = "kubernetes"``). A pod that
    requests slots (``who.slots``) is held to them in place of ``max_jobs_per_uid``.

    Raises:
        Busy: naming the limit reached (its config key) and the numbers.
    """
    if load.on_connection is not None and load.on_connection >= caps.max_jobs_per_connection:
        raise Busy(
            f"{load.on_connection} jobs running on this connection, the limit per connection "
            f"(limits.max_jobs_per_connection {caps.max_jobs_per_connection})"
        )
    if who.slots > 0:
        if load.pod_jails >= who.slots:
            raise Busy(
                f"{who} holds {load.pod_jails} jobs and sessions, its request "
                f"{caps.slot_resource}: {who.slots}; retry when one ends, or request more"
            )
    elif load.uid.jails >= caps.max_jobs_per_uid:
        raise Busy(
            f"{who.tenant} holds {load.uid.jails} jobs and sessions, its share "
            f"(limits.max_jobs_per_uid {caps.max_jobs_per_uid}); retry when one ends"
        )
    mine = load.uid.memory_mb + memory_mb
    if mine > caps.max_memory_mb_per_uid:
        raise Busy(
            f"{who.tenant}'s memory limits would reach {_mib(mine)} ({load.uid.memory_mb} MiB "
            f"held + {memory_mb} MiB for this one), over its share "
            f"(limits.max_memory_mb_per_uid {caps.max_memory_mb_per_uid}); retry when one ends"
        )
    if load.daemon.jails >= caps.max_jobs:
        raise Busy(
            f"{load.daemon.jails} jobs and sessions open, the daemon's limit "
            f"(limits.max_jobs {caps.max_jobs}); retry later"
        )
    total = load.daemon.memory_mb + memory_mb
    admitted = int(caps.max_memory_mb * caps.memory_overcommit)
    if total > admitted:
        rule = f"limits.max_memory_mb {caps.max_memory_mb}"
        if caps.memory_overcommit != 1:
            rule += f" x limits.memory_overcommit {caps.memory_overcommit:g} = {admitted} MiB"
        raise Busy(
            f"jails' memory limits would reach {_mib(total)} ({load.daemon.memory_mb} MiB "
            f"held + {memory_mb} MiB for this one), over what the daemon admits ({rule}); "
            "retry later"
        )


# --------------------------------------------------------------------------- the parts


def check_not_draining(catalog: Catalog) -> None:
    """No new work while the daemon drains: it stops once the jobs running finish.

    Raises:
        Busy: "draining", with how long the drain lasts at most.
    """
    if catalog.draining is not None:
        raise Busy(
            f"the daemon is draining: it stops once its running jobs finish (within "
            f"{catalog.draining:g} s, daemon.drain_s) and takes no new work; retry on "
            "another daemon, or here once it has restarted"
        )


def choose_policy(
    catalog: Catalog, peer: Peer, name: str, tools: tuple[ToolSpec, ...]
) -> Policy:
    """The policy a request names, if this peer may use it with these tools.

    Raises:
        ShuttingDown, UnknownPolicy, PolicyUnavailable, PermissionDenied, BadRequest.
    """
    if catalog.stopping:
        raise ShuttingDown("the daemon is shutting down")
    check_not_draining(catalog)
    policy = catalog.policies.get(name)
    if policy is None:
        raise UnknownPolicy(
            f"no policy {name!r}; this daemon serves: {', '.join(sorted(catalog.policies))}"
        )
    if policy.name in catalog.unavailable:
        raise PolicyUnavailable(
            f"policy {policy.name!r} is not served: {catalog.unavailable[policy.name]}"
        )
    if not catalog.may_use(policy, peer):
        raise PermissionDenied(f"{peer.principal} may not use policy {policy.name!r}")
    check_tools(policy, tools)
    return policy


def check_tools(policy: Policy, tools: tuple[ToolSpec, ...]) -> None:
    """Tool names unique and allowed by the policy; each one's parameters a JSON schema.

    Raises:
        BadRequest: a name given twice, or parameters that are not a schema.
        PermissionDenied: a tool the policy's ``access.tools`` does not allow.
    """
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("tool names must be unique")
    refused = [n for n in names if not policy.tool_allowed(n)]
    if refused:
        raise PermissionDenied(
            f"policy {policy.name!r} does not allow tool(s) {', '.join(refused)} "
            f"(allowed: {', '.join(policy.access.tools)})"
        )
    for tool in tools:
        problem = check_schema(tool.parameters)
        if problem:
            raise BadRequest(
                f"tool {tool.name!r}: its parameters are not a valid JSON schema: {problem}"
            )


def check_schema(schema: dict[str, Any]) -> str | None:
    """Why a tool's parameters are not a usable JSON schema, or None (empty: no schema).
    Checked once per distinct schema: clients send the same ones again and again."""
    if not schema:
        return None
    key = json.dumps(schema, sort_keys=True, default=repr)
    if key in _schema_problems:
        return _schema_problems[key]
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError

    problem = None
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        problem = exc.message[:SCHEMA_MESSAGE_CHARS]
    if len(_schema_problems) >= SCHEMA_MEMO_SIZE:
        _schema_problems.clear()
    _schema_problems[key] = problem
    return problem


def prepare_schema_checks() -> None:
    """Import jsonschema and check one schema now: its first use costs ~0.1 s (the import,
    the metaschema's validator), which the daemon pays at its start instead of on the clock
    of the first job that brings tools (issue 45, item 7). Safe in a worker thread."""
    check_schema({"type": "object", "properties": {"x": {"type": "integer"}},
                  "required": ["x"]})


def limits_for(policy: Policy, requested: Mapping[str, float]) -> Limits:
    """The policy's limits tightened by a request.

    Raises:
        BadRequest: an unknown limit, a bad value, or one looser than the policy's.
    """
    try:
        return effective_limits(policy, requested)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def check_code(policy: Policy, code: str) -> None:
    """The code within the policy's ``limits.code_bytes`` (UTF-8).

    Raises:
        BadRequest: naming its size and the limit.
    """
    code_bytes = len(code.encode("utf-8", "surrogatepass"))
    if code_bytes > policy.limits.code_bytes:
        raise BadRequest(
            f"the code is {code_bytes} bytes; policy {policy.name!r} accepts at most "
            f"{policy.limits.code_bytes}"
        )


def check_files(policy: Policy, files: Mapping[str, bytes], download: tuple[str, ...]) -> None:
    """Uploads within the policy's ``[files]`` limits, every name a plain relative path;
    download patterns without NUL.

    Raises:
        BadRequest: naming the upload or pattern and the reason.
    """
    if not files and not download:
        return
    problem = check_file_set(files, file_limits(policy))
    if problem is not None:
        path, reason = problem
        raise BadRequest(f"upload {path!r} refused by policy {policy.name!r}: {reason}")
    for pattern in download:
        if "\x00" in pattern:
            raise BadRequest(f"download pattern {pattern!r} contains NUL")


# --------------------------------------------------------------------------- requests


def admit_job(catalog: Catalog, peer: Peer, req: RunJob) -> AdmittedJob:
    """A one-shot ``RunJob``: its terms, or a refusal (see the table above)."""
    job = req.job
    policy = choose_policy(catalog, peer, req.policy, job.tools)
    check_code(policy, job.code)
    limits = limits_for(policy, req.limits)
    check_files(policy, job.files, job.download)
    return AdmittedJob(policy, limits, job, frozenset(req.labels))


def admit_session_run(terms: SessionTerms, session_id: str, req: RunJob) -> AdmittedJob:
    """A ``RunJob`` in an open session with these terms.

    Raises:
        BadRequest: another policy, tools given per run, a jail-level limit changed
            (it applies to the whole session), or as :func:`admit_job`.
    """
    policy = terms.policy
    if req.policy != policy.name:
        raise BadRequest(f"session {session_id} runs policy {policy.name!r}, not {req.policy!r}")
    job = req.job
    if job.tools and job.tools != terms.tools:
        raise BadRequest("a session's tools are given when it opens, not per run")
    check_code(policy, job.code)
    limits = limits_for(policy, {**terms.requested, **req.limits})
    fixed = [k for k in JAIL_LEVEL_LIMITS if getattr(limits, k) != getattr(terms.limits, k)]
    if fixed:
        raise BadRequest(
            f"{', '.join(sorted(fixed))} apply to the whole session; set them when opening it"
        )
    check_files(policy, job.files, job.download)
    if job.tools != terms.tools:
        job = dataclasses.replace(job, tools=terms.tools)
    return AdmittedJob(policy, limits, job, frozenset(req.labels))


def admit_session(
    catalog: Catalog, peer: Peer, req: OpenSession, open_of_uid: int
) -> SessionTerms:
    """An ``OpenSession``; ``open_of_uid``: the sessions the peer's uid has open.

    Raises:
        PermissionDenied: the policy allows no sessions; as :func:`choose_policy`.
        BadRequest: a limit, ``idle_s`` or ``max_lifetime_s`` looser than the policy's.
        Busy: the uid has the policy's ``session.max_per_user`` sessions open.
    """
    policy = choose_policy(catalog, peer, req.policy, req.tools)
    if not policy.session.enabled:
        raise PermissionDenied(f"policy {policy.name!r} does not allow sessions")
    limits_for(policy, req.limits)  # a bad limit is refused first, as before
    idle_s = policy.session.idle_s
    lifetime_s = policy.session.max_lifetime_s
    for key, wanted, allowed in (
        ("idle_s", req.idle_s, idle_s),
        ("max_lifetime_s", req.max_lifetime_s, lifetime_s),
    ):
        if wanted is not None and wanted > allowed:
            raise BadRequest(
                f"session {key}={wanted:g} is looser than policy {policy.name!r} allows "
                f"({allowed:g}); sessions may only tighten it"
            )
    pause_after_s = policy.session.pause_after_s
    wants_snapshots = req.pause_after_s is not None or req.from_snapshot is not None
    if wants_snapshots and not policy.session.snapshots:
        raise PermissionDenied(
            f"policy {policy.name!r} does not allow snapshots (session.snapshots = false)")
    if req.pause_after_s is not None:
        if pause_after_s and req.pause_after_s > pause_after_s:
            raise BadRequest(
                f"session pause_after_s={req.pause_after_s:g} is looser than policy "
                f"{policy.name!r} allows ({pause_after_s:g}); sessions may only tighten it")
        pause_after_s = req.pause_after_s
    if open_of_uid >= policy.session.max_per_user:
        raise Busy(
            f"{peer.principal} has {open_of_uid} sessions open; policy {policy.name!r} "
            f"allows {policy.session.max_per_user} per user"
        )
    return session_terms(policy, SessionAsked(
        idle_s=req.idle_s if req.idle_s is not None else idle_s,
        max_lifetime_s=req.max_lifetime_s if req.max_lifetime_s is not None else lifetime_s,
        pause_after_s=pause_after_s, tools=req.tools, requested=dict(req.limits),
    ), frozenset(req.labels))


__all__ = [
    "AdmittedJob",
    "Capacity",
    "Catalog",
    "Held",
    "Load",
    "SessionAsked",
    "SessionTerms",
    "admit_connection",
    "admit_job",
    "admit_session",
    "admit_session_run",
    "check_capacity",
    "check_code",
    "check_files",
    "check_schema",
    "check_tools",
    "choose_policy",
    "limits_for",
    "policy_allows",
    "prepare_schema_checks",
    "session_terms",
]
