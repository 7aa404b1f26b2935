"""Admission without root: every refusal, its type and its message."""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any

import pytest

from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.admission import Catalog, SessionTerms
from jaild.daemon.core.peer import Peer, Principal
from jaild.errors import (
    BadRequest,
    Busy,
    JaildError,
    PermissionDenied,
    PolicyUnavailable,
    ShuttingDown,
    UnknownPolicy,
)
from jaild.policy.schema import JAIL_LEVEL_LIMITS, ONE_SHOT_JAIL_LIMITS, Policy, load_policy_text
from jaild.protocol.messages import JobDescription, OpenSession, RunJob, ToolSpec

ALICE = Peer(pid=10, uid=1000, gid=1000)
BOB = Peer(pid=11, uid=1001, gid=1001, groups=(50,))


def policy(name: str = "default", text: str = "") -> Policy:
    return load_policy_text(text, f"{name}.toml")


def catalog(*policies: Policy, **kw: Any) -> Catalog:
    return Catalog({p.name: p for p in policies or (policy(),)}, **kw)


JOB_KEYS = {f.name for f in dataclasses.fields(JobDescription)}


def run(**kw: Any) -> RunJob:
    """A RunJob; the job description's keywords go into its ``job``."""
    job = {"code": "1 + 1", **{k: v for k, v in kw.items() if k in JOB_KEYS}}
    rest = {k: v for k, v in kw.items() if k not in JOB_KEYS}
    return RunJob(**{"ref": 1, "policy": "default", **rest, "job": JobDescription(**job)})


def refused(exc_type: type[JaildError], match: str, fn: Any, *args: Any, **kw: Any) -> None:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    assert type(info.value) is exc_type
    assert info.value.message == match


# --------------------------------------------------------------------------- connections


def connect(peer: Peer, others: list[Peer], users: tuple[str, ...] = ("*",)) -> None:
    admission.admit_connection(
        peer, others, allowed_users=users, max_connections=3, max_connections_per_uid=2
    )


def test_a_connection_within_the_limits_is_admitted() -> None:
    connect(ALICE, [ALICE, BOB])


def test_a_peer_not_in_allowed_users_is_refused() -> None:
    refused(PermissionDenied, "uid 1000 may not use this daemon", connect, ALICE, [], ("1001",))
    connect(BOB, [], ("1001",))  # positive control


def test_the_daemons_connection_limit() -> None:
    refused(
        Busy,
        "3 connections open, the daemon's limit (limits.max_connections 3); retry later",
        connect,
        ALICE,
        [BOB, BOB, ALICE],
    )


def test_the_connection_limit_per_uid() -> None:
    refused(
        Busy,
        "uid 1000 already has 2 connections, the limit per uid (limits.max_connections_per_uid 2)",
        connect,
        ALICE,
        [ALICE, ALICE],
    )


def test_the_peers_groups_count_for_allowed_users() -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []

    def matches(entries: Any, uid: int, gids: tuple[int, ...]) -> bool:
        seen.append((uid, gids))
        return True

    admission.admit_connection(
        BOB, [], allowed_users=("@g",), max_connections=1, max_connections_per_uid=1,
        matches=matches,
    )
    assert seen == [(1001, (1001, 50))]


# --------------------------------------------------------------------------- capacity


CAPS = admission.Capacity(max_jobs=8, max_jobs_per_connection=6, max_jobs_per_uid=4,
                          max_memory_mb=1024, max_memory_mb_per_uid=512)


def load(daemon: tuple[int, int] = (0, 0), uid: tuple[int, int] = (0, 0),
         on_connection: int | None = None) -> admission.Load:
    return admission.Load(admission.Held(*daemon), admission.Held(*uid), on_connection)


def test_capacity_admits_within_every_limit() -> None:
    admission.check_capacity(Principal.of_uid(1000), load((7, 896), (3, 384), 5), CAPS, 128)
    admission.check_capacity(Principal.of_uid(1000), load(), CAPS, 512)  # exactly the uid's share: allowed


def test_capacity_refuses_the_connection_at_its_limit() -> None:
    refused(Busy, "6 jobs running on this connection, the limit per connection "
            "(limits.max_jobs_per_connection 6)",
            admission.check_capacity, Principal.of_uid(1000), load((6, 0), (3, 0), 6), CAPS, 1)


def test_a_uid_at_its_share_of_jails_is_refused_and_another_uid_is_not() -> None:
    held = load(daemon=(4, 256), uid=(4, 256))
    refused(Busy, "uid 1000 holds 4 jobs and sessions, its share "
            "(limits.max_jobs_per_uid 4); retry when one ends",
            admission.check_capacity, Principal.of_uid(1000), held, CAPS, 64)
    # the same daemon, as another uid holding nothing: there is room
    admission.check_capacity(Principal.of_uid(1001), load(daemon=(4, 256)), CAPS, 64)


def test_a_uid_at_its_share_of_memory_is_refused_and_another_uid_is_not() -> None:
    held = load(daemon=(2, 448), uid=(2, 448))
    refused(Busy, "uid 1000's memory limits would reach 576 MiB (448 MiB held + 128 MiB "
            "for this one), over its share (limits.max_memory_mb_per_uid 512); retry when one ends",
            admission.check_capacity, Principal.of_uid(1000), held, CAPS, 128)
    admission.check_capacity(Principal.of_uid(1000), held, CAPS, 64)  # a smaller one fits its share
    admission.check_capacity(Principal.of_uid(1001), load(daemon=(2, 448)), CAPS, 128)


def pod(name: str, slots: int = 0) -> Principal:
    return Principal("pod", 1000, f"uid-of-{name}", "agents", name, "default", slots=slots)


def test_a_pod_over_its_slot_request_is_refused_naming_it() -> None:
    one = pod("agent-a", slots=1)
    # the control: the same pod holding nothing is admitted
    admission.check_capacity(one, dataclasses.replace(load(daemon=(3, 256)), pod_jails=0),
                             CAPS, 64)
    held = dataclasses.replace(load(daemon=(3, 256), uid=(1, 64)), pod_jails=1)
    refused(Busy, "pod agents/agent-a holds 1 jobs and sessions, its request "
            "jaild.dev/slots: 1; retry when one ends, or request more",
            admission.check_capacity, one, held, CAPS, 64)
    named = dataclasses.replace(CAPS, slot_resource="example.com/jails")
    refused(Busy, "pod agents/agent-a holds 1 jobs and sessions, its request "
            "example.com/jails: 1; retry when one ends, or request more",
            admission.check_capacity, one, held, named, 64)


def test_a_pods_slot_request_takes_the_place_of_the_share_of_jails() -> None:
    # six slots: a fifth jail is admitted past max_jobs_per_uid (4), as the scheduler granted
    six = dataclasses.replace(load(daemon=(4, 256), uid=(4, 256)), pod_jails=4)
    admission.check_capacity(pod("agent-b", slots=6), six, CAPS, 64)
    # the control: a pod that requests no slots is held to the share as before
    refused(Busy, "pod agents/agent-b holds 4 jobs and sessions, its share "
            "(limits.max_jobs_per_uid 4); retry when one ends",
            admission.check_capacity, pod("agent-b"), six, CAPS, 64)
    # its memory share and the daemon's limits still apply
    refused(Busy, "pod agents/agent-b's memory limits would reach 768 MiB (256 MiB held + "
            "512 MiB for this one), over its share (limits.max_memory_mb_per_uid 512); "
            "retry when one ends",
            admission.check_capacity, pod("agent-b", slots=6), six, CAPS, 512)
    full = dataclasses.replace(load(daemon=(8, 512), uid=(4, 256)), pod_jails=4)
    refused(Busy, "8 jobs and sessions open, the daemon's limit (limits.max_jobs 8); "
            "retry later",
            admission.check_capacity, pod("agent-b", slots=6), full, CAPS, 1)


def test_the_daemon_at_its_jail_limit_refuses_everyone() -> None:
    refused(Busy, "8 jobs and sessions open, the daemon's limit (limits.max_jobs 8); retry later",
            admission.check_capacity, Principal.of_uid(1001), load(daemon=(8, 512)), CAPS, 1)


def test_the_memory_ceiling_counts_every_jails_limit() -> None:
    # 896 held by others + 256 for this one > 1024: refused
    refused(Busy, "jails' memory limits would reach 1.1 GiB (896 MiB held + 256 MiB for this "
            "one), over what the daemon admits (limits.max_memory_mb 1024); retry later",
            admission.check_capacity, Principal.of_uid(1001), load((5, 896)), CAPS, 256)
    admission.check_capacity(Principal.of_uid(1001), load((5, 896)), CAPS, 128)  # exactly full


def test_the_memory_limits_may_overcommit_the_ceiling_by_the_configured_factor() -> None:
    twice = dataclasses.replace(CAPS, max_memory_mb_per_uid=2048, memory_overcommit=2.0)
    admission.check_capacity(Principal.of_uid(1001), load((5, 1792)), twice, 256)  # 2048 of 1024 x 2: fits
    refused(Busy, "jails' memory limits would reach 2.0 GiB (1792 MiB held + 257 MiB for this "
            "one), over what the daemon admits (limits.max_memory_mb 1024 x "
            "limits.memory_overcommit 2 = 2048 MiB); retry later",
            admission.check_capacity, Principal.of_uid(1001), load((5, 1792)), twice, 257)


def test_the_derived_shares_follow_the_overcommit() -> None:
    config = DaemonConfig(max_memory_mb=1000, memory_overcommit=4.0)
    assert (config.memory_admitted_mb, config.memory_mb_per_uid) == (4000, 2000)
    strict = DaemonConfig(max_memory_mb=1000, memory_overcommit=1.0)
    assert (strict.memory_admitted_mb, strict.memory_mb_per_uid) == (1000, 500)


def test_fairness_off_one_uid_takes_everything() -> None:
    # positive control: per-uid caps equal to the daemon's let one uid hold it all, and
    # the next uid is refused by the daemon's limit
    off = admission.Capacity(8, 8, 8, 1024, 1024)
    admission.check_capacity(Principal.of_uid(1000), load((7, 896), (7, 896)), off, 128)
    refused(Busy, "8 jobs and sessions open, the daemon's limit (limits.max_jobs 8); retry later",
            admission.check_capacity, Principal.of_uid(1001), load((8, 1024)), off, 64)


def test_derived_defaults_of_the_shares_and_the_ceiling(tmp_path: Any) -> None:
    from jaild.daemon.config import host_memory_mb
    from jaild.daemon.sessions import capacity

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:         1 kB\n")
    assert host_memory_mb(str(meminfo)) == 24105
    derived = capacity(DaemonConfig(max_jobs=512))
    host = host_memory_mb()
    assert derived == admission.Capacity(
        max_jobs=512, max_jobs_per_connection=256, max_jobs_per_uid=256,
        max_memory_mb=host * 3 // 4, max_memory_mb_per_uid=host * 3 // 4 * 4 // 2,
        memory_overcommit=4.0)
    assert capacity(DaemonConfig(max_jobs=1)).max_jobs_per_uid == 1  # at least one
    given = capacity(DaemonConfig(max_jobs=8, max_jobs_per_uid=3, max_memory_mb=1000,
                                  max_memory_mb_per_uid=300, memory_overcommit=1.0))
    assert given == admission.Capacity(8, 256, 3, 1000, 300)
    # a share larger than what the daemon admits is all of it
    assert capacity(DaemonConfig(max_jobs=8, max_jobs_per_uid=20, max_memory_mb=1000,
                                 max_memory_mb_per_uid=5000, memory_overcommit=1.0)) == \
        admission.Capacity(8, 256, 8, 1000, 1000)


def test_what_a_uid_holds_counts_jobs_and_sessions_once_each() -> None:
    from types import SimpleNamespace

    from jaild.daemon.registry import LiveJob, Registry

    def conn(uid: int) -> Any:
        return SimpleNamespace(peer=Peer(pid=1, uid=uid, gid=uid))

    def sess(sid: str, owner: Any, memory_mb: int, holds_jail: bool = True) -> Any:
        limits = SimpleNamespace(memory_mb=memory_mb)
        return SimpleNamespace(id=sid, owner=owner, terms=SimpleNamespace(jail_limits=limits),
                               holds_jail=holds_jail)

    reg = Registry()
    a, b = conn(1000), conn(1001)
    s1 = sess("ses-1", a, 512)
    reg.add_session(s1)
    reg.add_job(LiveJob("job-1", SimpleNamespace(pid=None), a, memory_mb=256))  # type: ignore[arg-type]
    # a run in the session: its jail is the session's, already counted
    reg.add_job(LiveJob("job-2", SimpleNamespace(pid=None), a, s1))  # type: ignore[arg-type]
    reg.add_job(LiveJob("job-3", SimpleNamespace(pid=None), b, memory_mb=128))  # type: ignore[arg-type]
    reg.add_session(sess("ses-2", a, 1024, holds_jail=False))  # paused to disk: no jail
    assert reg.held(1000) == admission.Held(jails=2, memory_mb=768)
    assert reg.held(1001) == admission.Held(jails=1, memory_mb=128)
    assert reg.held() == admission.Held(jails=3, memory_mb=896)
    reg.remove_job("job-1")
    reg.remove_session(s1)
    assert reg.held(1000) == admission.Held(jails=0, memory_mb=0)


# --------------------------------------------------------------------------- policies


def test_a_job_is_admitted_with_its_terms() -> None:
    req = run(limits={"memory_mb": 64}, files={"a.txt": b"x"}, download=("*.txt",),
              download_changed=True, filename="<x>")
    job = admission.admit_job(catalog(), ALICE, req)
    assert job.policy.name == "default" and job.limits.memory_mb == 64
    assert (job.job.code, job.job.filename, job.job.files, job.job.download,
            job.job.download_changed) == (
        "1 + 1", "<x>", {"a.txt": b"x"}, ("*.txt",), True,
    )
    assert job.job is req.job  # carried whole, not copied field by field


def test_no_new_work_while_shutting_down() -> None:
    refused(ShuttingDown, "the daemon is shutting down",
            admission.admit_job, catalog(stopping=True), ALICE, run())


def test_no_new_work_while_draining_and_how_long_the_drain_lasts() -> None:
    """A draining daemon (SIGTERM with daemon.drain_s) refuses jobs and sessions busy; the
    same requests are admitted when it is not (the control)."""
    draining = catalog(draining=30.0)
    said = ("the daemon is draining: it stops once its running jobs finish (within 30 s, "
            "daemon.drain_s) and takes no new work; retry on another daemon, or here once it "
            "has restarted")
    refused(Busy, said, admission.admit_job, draining, ALICE, run())
    refused(Busy, said, admission.admit_session, draining, ALICE, open_session(), 0)
    admission.admit_job(catalog(), ALICE, run())
    admission.admit_session(catalog(), ALICE, open_session(), 0)


def test_an_unknown_policy_names_those_served() -> None:
    refused(UnknownPolicy, "no policy 'nope'; this daemon serves: a, default",
            admission.admit_job, catalog(policy(), policy("a")), ALICE, run(policy="nope"))


def test_a_policy_not_served_says_why() -> None:
    cat = catalog(unavailable={"default": "it failed its self-test at start: x"})
    refused(PolicyUnavailable,
            "policy 'default' is not served: it failed its self-test at start: x",
            admission.admit_job, cat, ALICE, run())


def test_access_users_decides_who_may_use_a_policy() -> None:
    cat = catalog(policy(text='[access]\nusers = ["1001"]\n'))
    refused(PermissionDenied, "uid 1000 may not use policy 'default'",
            admission.admit_job, cat, ALICE, run())
    assert admission.admit_job(cat, BOB, run()).policy.name == "default"


def test_may_use_is_the_catalogs_to_give() -> None:
    cat = catalog(may_use=lambda p, peer: peer.uid == 1000)
    admission.admit_job(cat, ALICE, run())
    refused(PermissionDenied, "uid 1001 may not use policy 'default'",
            admission.admit_job, cat, BOB, run())


# --------------------------------------------------------------------------- tools


def test_tool_names_must_be_unique() -> None:
    tools = (ToolSpec(name="f"), ToolSpec(name="f"))
    refused(BadRequest, "tool names must be unique",
            admission.admit_job, catalog(), ALICE, run(tools=tools))


def test_tools_the_policy_does_not_allow() -> None:
    cat = catalog(policy(text='[access]\ntools = ["fetch_*", "get"]\n'))
    tools = (ToolSpec(name="fetch_url"), ToolSpec(name="rm"), ToolSpec(name="sh"))
    refused(PermissionDenied,
            "policy 'default' does not allow tool(s) rm, sh (allowed: fetch_*, get)",
            admission.admit_job, cat, ALICE, run(tools=tools))
    assert admission.admit_job(cat, ALICE, run(tools=tools[:1])).job.tools == tools[:1]


def test_a_tools_parameters_must_be_a_json_schema() -> None:
    bad = ToolSpec(name="f", parameters={"type": "no-such-type"})
    with pytest.raises(BadRequest) as info:
        admission.admit_job(catalog(), ALICE, run(tools=(bad,)))
    assert info.value.message.startswith(
        "tool 'f': its parameters are not a valid JSON schema: 'no-such-type' is not valid"
    )
    good = ToolSpec(name="f", parameters={"type": "object", "properties": {"x": {}}})
    admission.admit_job(catalog(), ALICE, run(tools=(good,)))


def test_check_schema_answers_the_same_for_the_same_schema() -> None:
    schema = {"type": 5}
    first = admission.check_schema(schema)
    assert first is not None and admission.check_schema(dict(schema)) == first
    assert admission.check_schema({}) is None
    assert len(first) <= admission.SCHEMA_MESSAGE_CHARS


# --------------------------------------------------------------------------- code, limits, files


def test_code_over_the_policys_size() -> None:
    cat = catalog(policy(text="[limits]\ncode_bytes = 1024\n"))
    refused(BadRequest, "the code is 1025 bytes; policy 'default' accepts at most 1024",
            admission.admit_job, cat, ALICE, run(code="x" * 1025))
    refused(BadRequest, "the code is 1026 bytes; policy 'default' accepts at most 1024",
            admission.admit_job, cat, ALICE, run(code="é" * 513))  # UTF-8 bytes count
    admission.admit_job(cat, ALICE, run(code="x" * 1024))


def test_looser_limits_are_refused() -> None:
    refused(BadRequest,
            "limit memory_mb=512 is looser than policy 'default' allows (256); "
            "jobs may only tighten limits",
            admission.admit_job, catalog(), ALICE, run(limits={"memory_mb": 512}))


def test_unknown_and_bad_limits_are_refused() -> None:
    with pytest.raises(BadRequest, match=r"^unknown limit 'memroy_mb'; limits are: wall_time_s"):
        admission.admit_job(catalog(), ALICE, run(limits={"memroy_mb": 1}))
    refused(BadRequest, "limit pids=0 must be a positive number",
            admission.admit_job, catalog(), ALICE, run(limits={"pids": 0}))


def test_uploads_within_the_policys_files_limits() -> None:
    cat = catalog(policy(text="[files]\nmax_files = 1\n"))
    with pytest.raises(BadRequest) as info:
        admission.admit_job(cat, ALICE, run(files={"a": b"", "b": b""}))
    assert info.value.message.startswith("upload ")
    assert "refused by policy 'default': " in info.value.message
    with pytest.raises(BadRequest, match=r"^upload '\.\./x' refused by policy 'default': "):
        admission.admit_job(catalog(), ALICE, run(files={"../x": b""}))


def test_download_patterns_without_nul() -> None:
    refused(BadRequest, "download pattern 'a\\x00' contains NUL",
            admission.admit_job, catalog(), ALICE, run(download=("a\x00",)))


def test_file_limits_are_the_policys() -> None:
    limits = admission.file_limits(policy(text="[files]\nmax_files = 7\nmax_depth = 3\n"))
    assert (limits.max_files, limits.max_depth) == (7, 3)


def test_the_first_failing_check_is_the_one_reported() -> None:
    # unknown tool and oversize code and a looser limit: the policy's tools come first
    cat = catalog(policy(text='[access]\ntools = []\n[limits]\ncode_bytes = 1024\n'))
    req = run(tools=(ToolSpec(name="f"),), code="x" * 2000, limits={"memory_mb": 1 << 19})
    with pytest.raises(PermissionDenied):
        admission.admit_job(cat, ALICE, req)
    with pytest.raises(BadRequest, match=r"^the code is 2000 bytes"):
        admission.admit_job(cat, ALICE, run(code="x" * 2000, limits={"memory_mb": 1 << 19}))


# --------------------------------------------------------------------------- syntax


def test_the_daemon_never_compiles_a_jobs_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Untrusted source meets CPython's compiler only in the jail: admission admits code that
    does not compile, as any other, without compiling it (its record comes from the jail)."""
    compiled: list[object] = []
    real = builtins.compile

    def watching(source: object, *args: object, **kwargs: object) -> object:
        compiled.append(source)
        return real(source, *args, **kwargs)  # type: ignore[call-overload]

    codes = ("def (:\n", "x = '\x00'", "await f()", "x = 1")
    session = terms("")
    monkeypatch.setattr(builtins, "compile", watching)
    for code in codes:
        assert admission.admit_job(catalog(), ALICE, run(code=code)).job.code == code
        assert admission.admit_session_run(session, "ses-1", run(code=code)).job.code == code
    assert not [c for c in compiled if c in codes]


# --------------------------------------------------------------------------- sessions


def open_session(**kw: Any) -> OpenSession:
    return OpenSession(**{"ref": 1, "policy": "default", **kw})


def test_a_session_is_admitted_with_its_terms() -> None:
    p = policy(text="[session]\ncpu_time_s = 99\n")
    tools = (ToolSpec(name="f"),)
    terms = admission.admit_session(
        catalog(p), ALICE, open_session(limits={"memory_mb": 64}, tools=tools, idle_s=5), 0
    )
    assert terms.limits.memory_mb == 64 and terms.limits.cpu_time_s == p.limits.cpu_time_s
    assert terms.jail_limits.cpu_time_s == 99 and terms.jail_limits.memory_mb == 64
    assert terms.tools == tools and terms.requested == {"memory_mb": 64}
    assert (terms.idle_s, terms.max_lifetime_s) == (5, p.session.max_lifetime_s)


def test_a_policy_without_sessions() -> None:
    cat = catalog(policy(text="[session]\nenabled = false\n"))
    refused(PermissionDenied, "policy 'default' does not allow sessions",
            admission.admit_session, cat, ALICE, open_session(), 0)


def test_a_session_may_only_tighten_idle_and_lifetime() -> None:
    refused(BadRequest,
            "session idle_s=301 is looser than policy 'default' allows (300); "
            "sessions may only tighten it",
            admission.admit_session, catalog(), ALICE, open_session(idle_s=301), 0)
    refused(BadRequest,
            "session max_lifetime_s=3601 is looser than policy 'default' allows (3600); "
            "sessions may only tighten it",
            admission.admit_session, catalog(), ALICE, open_session(max_lifetime_s=3601), 0)


def test_sessions_per_user() -> None:
    cat = catalog(policy(text="[session]\nmax_per_user = 2\n"))
    admission.admit_session(cat, ALICE, open_session(), 1)
    refused(Busy, "uid 1000 has 2 sessions open; policy 'default' allows 2 per user",
            admission.admit_session, cat, ALICE, open_session(), 2)


def test_opening_a_session_checks_the_policy_as_a_job_does() -> None:
    refused(UnknownPolicy, "no policy 'x'; this daemon serves: default",
            admission.admit_session, catalog(), ALICE, open_session(policy="x"), 0)
    refused(ShuttingDown, "the daemon is shutting down",
            admission.admit_session, catalog(stopping=True), ALICE, open_session(), 0)


def terms(text: str = "", **kw: Any) -> SessionTerms:
    return admission.admit_session(catalog(policy(text=text)), ALICE, open_session(**kw), 0)


def test_a_sessions_run_gets_the_sessions_tools_and_limits() -> None:
    tools = (ToolSpec(name="f"),)
    t = terms(tools=tools, limits={"memory_mb": 64, "wall_time_s": 5})
    job = admission.admit_session_run(t, "ses-1", run())
    assert job.job.tools == tools and job.limits.memory_mb == 64 and job.limits.wall_time_s == 5
    job = admission.admit_session_run(t, "ses-1", run(tools=tools, limits={"wall_time_s": 2}))
    assert job.limits.wall_time_s == 2


def test_a_sessions_run_names_its_policy() -> None:
    refused(BadRequest, "session ses-1 runs policy 'default', not 'other'",
            admission.admit_session_run, terms(), "ses-1", run(policy="other"))


def test_a_sessions_tools_are_given_when_it_opens() -> None:
    refused(BadRequest, "a session's tools are given when it opens, not per run",
            admission.admit_session_run, terms(), "ses-1", run(tools=(ToolSpec(name="f"),)))


@pytest.mark.parametrize("name", JAIL_LEVEL_LIMITS)
def test_a_sessions_run_cannot_change_a_jail_level_limit(name: str) -> None:
    t = terms("[limits]\ncpu_cores = 1\n")
    value = getattr(t.limits, name) / 2
    refused(BadRequest, f"{name} apply to the whole session; set them when opening it",
            admission.admit_session_run, t, "ses-1", run(limits={name: value}))


def test_a_sessions_run_has_its_own_cpu_time() -> None:
    job = admission.admit_session_run(terms(), "ses-1", run(limits={"cpu_time_s": 1}))
    assert job.limits.cpu_time_s == 1


def test_a_sessions_run_is_checked_as_a_job_is() -> None:
    t = terms("[limits]\ncode_bytes = 1024\n")
    refused(BadRequest, "the code is 2000 bytes; policy 'default' accepts at most 1024",
            admission.admit_session_run, t, "ses-1", run(code="x" * 2000))
    refused(BadRequest, "download pattern 'a\\x00' contains NUL",
            admission.admit_session_run, t, "ses-1", run(download=("a\x00",)))


def test_jail_level_limits_are_declared_once() -> None:
    assert "cpu_time_s" not in JAIL_LEVEL_LIMITS
    assert (*JAIL_LEVEL_LIMITS, "cpu_time_s") == ONE_SHOT_JAIL_LIMITS


# --------------------------------------------------------------------------- pods as tenants

POD_A = Principal("pod", 1000, "0b1f6a52-3f1e-4d7a-9c1e-5a6b7c8d9e0f", "agents", "agent-a",
                  "codemode")
POD_B = Principal("pod", 1000, "9c2d7b63-4a2f-4e8b-8d2f-6b7c8d9e0f1a", "agents", "agent-b",
                  "codemode")


def test_two_pods_of_one_uid_are_two_tenants() -> None:
    """Pods usually run as one uid: each is its own principal, with its own share, its own
    zygotes and pools (the key), and root in a pod is no admin."""
    a, b = Peer(10, 1000, 1000, principal=POD_A), Peer(11, 1000, 1000, principal=POD_B)
    assert a.principal.key != b.principal.key and a.principal.key != ALICE.principal.key
    assert str(a.principal) == "pod agents/agent-a" and str(ALICE.principal) == "uid 1000"
    assert not Principal("pod", 0, POD_A.pod_uid, "agents", "x", "y").admin
    assert Principal.of_uid(0).admin
    held = load(daemon=(4, 256), uid=(4, 256))
    refused(Busy, "pod agents/agent-a holds 4 jobs and sessions, its share "
            "(limits.max_jobs_per_uid 4); retry when one ends",
            admission.check_capacity, POD_A, held, CAPS, 64)
    admission.check_capacity(POD_B, load(daemon=(4, 256)), CAPS, 64)  # the other pod: room
    connect(b, [a, a])  # pod A's connections do not count against pod B
    refused(Busy, "pod agents/agent-a already has 2 connections, the limit per pod "
            "(limits.max_connections_per_uid 2)", connect, a, [a, a])


def test_pods_of_one_service_account_are_one_tenant_where_accounts_are_tenants() -> None:
    """``access.tenant = "serviceaccount"``: two pods of one account share one key (one
    share, one owner of snapshots and parked runs), named as the account; another account
    in the namespace, or the same account name in another namespace, is another tenant.
    The control: the same pods as pods are two."""
    a, b = (dataclasses.replace(p, by_account=True) for p in (POD_A, POD_B))
    assert a.key == b.key and POD_A.key != POD_B.key
    assert a.key.startswith("sa-") and a.key != POD_A.key
    assert a.key != dataclasses.replace(a, service_account="reporting").key
    assert a.key != dataclasses.replace(a, namespace="web").key
    assert str(a) == "pod agents/agent-a"  # the audit still names the pod
    refused(Busy, "service account agents/codemode holds 4 jobs and sessions, its share "
            "(limits.max_jobs_per_uid 4); retry when one ends",
            admission.check_capacity, b, load(daemon=(4, 256), uid=(4, 256)), CAPS, 64)


def test_service_accounts_as_tenants_need_the_api() -> None:
    from jaild.daemon.config import DaemonConfig
    from jaild.daemon.principals import principals
    from jaild.errors import StartupError

    config = DaemonConfig(identity="kubernetes", kubernetes_api="none", tenant="serviceaccount")
    with pytest.raises(StartupError, match=r'access.tenant = "serviceaccount".*"none"'):
        principals(config)


def test_a_policy_admits_pods_by_namespace_and_service_account() -> None:
    policy = load_policy_text(
        '[access]\nnamespaces = ["agents"]\nservice_accounts = ["agents/codemode"]\n',
        "agents.toml",
    )
    catalog = Catalog({"agents": policy})
    a = Peer(10, 1000, 1000, principal=POD_A)
    assert admission.admit_job(catalog, a, run(policy="agents")).policy is policy
    other_ns = Peer(10, 1000, 1000, principal=dataclasses.replace(POD_A, namespace="web"))
    refused(PermissionDenied, "pod web/agent-a may not use policy 'agents'",
            admission.admit_job, catalog, other_ns, run(policy="agents"))
    other_sa = Peer(10, 1000, 1000, principal=dataclasses.replace(POD_A, service_account="x"))
    refused(PermissionDenied, "pod agents/agent-a may not use policy 'agents'",
            admission.admit_job, catalog, other_sa, run(policy="agents"))
    # a client outside any pod is judged by access.users alone
    assert admission.admit_job(catalog, ALICE, run(policy="agents")).policy is policy
