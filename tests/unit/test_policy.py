"""Policy loading and validation: every error names file, key path and reason."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jaild.errors import PolicyError
from jaild.policy.schema import (
    Bind,
    Limits,
    check_policy_files,
    effective_limits,
    host_checks,
    load_policy,
    load_policy_dir,
    load_policy_text,
    reference_markdown,
)
from tests.conftest import world_tempdir

REPO = Path(__file__).resolve().parents[2]


def load(text: str, name: str = "p") -> object:
    return load_policy_text(text, f"/etc/jaild/policies/{name}.toml")


def error_of(text: str, name: str = "p") -> str:
    with pytest.raises(PolicyError) as info:
        load(text, name)
    return info.value.message


def test_shipped_policies_load() -> None:
    policies = load_policy_dir(REPO / "policies")
    assert set(policies) >= {"default", "strict"}
    default, strict = policies["default"], policies["strict"]
    assert (default.limits.memory_mb, default.limits.wall_time_s, default.limits.pids) == (256, 30.0, 64)
    assert default.limits.output_bytes == 1 << 20
    assert default.network.mode == "none"
    # strict is strictly tighter
    for f in dataclasses.fields(Limits):
        if f.name == "cpu_cores":
            continue
        assert getattr(strict.limits, f.name) <= getattr(default.limits, f.name), f.name
    assert strict.seccomp.profile == "strict"


def test_defaults_for_an_empty_policy() -> None:
    p = load("")
    assert p.name == "p"  # type: ignore[attr-defined]
    assert p.filesystem.binds == (Bind("/usr", "/usr"),)  # type: ignore[attr-defined]
    assert p.limits == Limits()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1", "/etc/jaild/policies/p.toml: colour: unknown key; a policy accepts access, approvals, description, egress, files, filesystem, flow, limits, network, pool, python, seccomp, session"),
        ("[limits]\nmemroy_mb = 1", "p.toml: limits.memroy_mb: unknown key; [limits] accepts wall_time_s, cpu_time_s, memory_mb"),
        ("[limits]\nmemory_mb = '256'", "p.toml: limits.memory_mb: must be an integer, got '256'"),
        ("[limits]\nmemory_mb = 256.5", "p.toml: limits.memory_mb: must be an integer, got 256.5"),
        ("[limits]\npids = true", "p.toml: limits.pids: must be an integer, got True"),
        ("[limits]\nmemory_mb = 8", "p.toml: limits.memory_mb: must be between 16 and 1048576, got 8"),
        ("[limits]\nwall_time_s = 0", "p.toml: limits.wall_time_s: must be between 0.01 and 86400, got 0.0"),
        ("limits = 5", "p.toml: limits: must be a table, got int"),
        ("[network]\nmode = 'internet'", "p.toml: network.mode: must be one of none, loopback, host, egress; got 'internet'"),
        ("[filesystem]\nproc = 'some'", "p.toml: filesystem.proc: must be one of pid-only, full, none"),
        ("[filesystem]\nbinds = ['usr']", "p.toml: filesystem.binds[0].src: must be an absolute path, got 'usr'"),
        ("[filesystem]\nbinds = ['/usr/../etc']", "p.toml: filesystem.binds[0].src: must be a normalised path"),
        ("[filesystem]\nbinds = [{src = '/srv', dst = '/tmp/x'}]", "p.toml: filesystem.binds[0].dst: /tmp/x is reserved by jaild inside the jail"),
        ("[filesystem]\nbinds = [{src = '/srv', dst = '/'}]", "p.toml: filesystem.binds[0].dst: / is reserved"),
        ("[filesystem]\nbinds = [{source = '/srv'}]", 'p.toml: filesystem.binds[0]: must be "/path" or {src = "/path", dst = "/path"}'),
        ("[filesystem]\nbinds = '/usr'", "p.toml: filesystem.binds: must be a list, got str"),
        ("[seccomp]\nallow = ['frobnicate']", "p.toml: seccomp.allow: unknown syscall 'frobnicate' (not a syscall on this architecture)"),
        ("[seccomp]\nallow = ['@nonsense']", "p.toml: seccomp.allow: unknown syscall group '@nonsense'"),
        ("[seccomp]\nallow = ['ptrace']", "p.toml: seccomp.allow: 'ptrace' can never be allowed: it inspects or alters other processes"),
        ("[seccomp]\nallow = ['mount']", "p.toml: seccomp.allow: 'mount' can never be allowed: it changes the mount table"),
        ("[seccomp]\ndeny = ['nosuchcall']", "p.toml: seccomp.deny: unknown syscall 'nosuchcall'"),
        ("[seccomp]\nprofile = 'loose'", "p.toml: seccomp.profile: must be one of default, strict; got 'loose'"),
        ("[seccomp]\naction = 'log'", "p.toml: seccomp.action: must be one of kill, errno; got 'log'"),
        ("[seccomp]\nallow = [1]", "p.toml: seccomp.allow[0]: must be a string, got 1"),
        ("[python]\nenv = '../x'", "p.toml: python.env: '../x' is neither an env name nor an absolute path"),
        ("description = 3", "p.toml: description: must be a string, got 3"),
        ("[limits", "p.toml: not valid TOML"),
        ("[approvals]\npark_after_s = 30", "p.toml: approvals.park_after_s: 30 s is not below "
                                           "limits.wall_time_s (30 s)"),
        ("[approvals]\napprovers = 'me'", "p.toml: approvals.approvers: must be a list"),
        ("[session]\nsnapshot_max_mb = 100", "p.toml: session.snapshot_max_mb: must be between 1 "
                                              "and 60, got 100"),
    ],
)
def test_errors_name_file_key_and_reason(text: str, message: str) -> None:
    assert message in error_of(text)


def test_policy_name_comes_from_the_file_name() -> None:
    assert "policy name 'Bad Name!' must match" in error_of("", name="Bad Name!")


def test_unreadable_and_missing(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(tmp_path / "bin.toml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match=r"no \*\.toml policies"):
        load_policy_dir(tmp_path / "empty")


def test_host_checks_name_the_problem(tmp_path: Path) -> None:
    p = load('[filesystem]\nbinds = ["/usr", "/nonexistent-jaild"]\n[python]\nenv = "ghost"')
    problems = [e.message for e in host_checks(p, str(tmp_path))]  # type: ignore[arg-type]
    assert any("filesystem.binds[1].src: /nonexistent-jaild does not exist on this host" in m for m in problems)
    assert any(f"python.env: environment {tmp_path}/ghost does not exist" in m for m in problems)


def test_host_checks_refuse_an_env_the_jail_cannot_see() -> None:
    import shutil

    root = world_tempdir("jaild-test-env-")
    try:
        interpreter = root / "elsewhere" / "python3.11"  # like a pyenv build under /root
        interpreter.parent.mkdir()
        interpreter.write_text("")
        env = root / "envs" / "bad"
        (env / "bin").mkdir(parents=True)
        (env / "bin" / "python3").symlink_to(interpreter)
        for d in (root / "envs", env, env / "bin"):
            d.chmod(0o755)
        p = load('[python]\nenv = "bad"')
        problems = [e.message for e in host_checks(p, str(root / "envs"))]  # type: ignore[arg-type]
        assert problems == [
            f"/etc/jaild/policies/p.toml: python.env: {env}/bin/python3 resolves to {interpreter}, "
            "which the jail cannot see (not under any bind); rebuild the env from a system "
            "interpreter, e.g. /usr/bin/python3"
        ]
        (env).chmod(0o700)
        problems = [e.message for e in host_checks(p, str(root / "envs"))]  # type: ignore[arg-type]
        assert any("is not world-searchable" in m for m in problems), problems
    finally:
        shutil.rmtree(root)


def test_jobs_may_only_tighten_limits() -> None:
    p = load("[limits]\nmemory_mb = 256\nwall_time_s = 30")
    limits = effective_limits(p, {"memory_mb": 100, "wall_time_s": 2.5})  # type: ignore[arg-type]
    assert (limits.memory_mb, limits.wall_time_s) == (100, 2.5)
    with pytest.raises(ValueError, match="memory_mb=300 is looser than policy 'p' allows \\(256\\)"):
        effective_limits(p, {"memory_mb": 300})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown limit 'ram'"):
        effective_limits(p, {"ram": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a positive number"):
        effective_limits(p, {"pids": -1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit memory_mb: must be between 16"):
        effective_limits(p, {"memory_mb": 1})  # type: ignore[arg-type]
    # a policy without a CPU cap accepts any cap
    assert effective_limits(p, {"cpu_cores": 0.5}).cpu_cores == 0.5  # type: ignore[arg-type]
    # asking for nothing is the policy's own limits (checked when it loaded), not a copy
    assert effective_limits(p, {}) is p.limits
    assert effective_limits(p, {"memory_mb": 256}) == p.limits  # type: ignore[arg-type]


def test_access_rules() -> None:
    p = load('[access]\ntools = ["search*", "fetch"]\nusers = ["root", "1000", "@nogroup"]')
    assert p.tool_allowed("search_web") and p.tool_allowed("fetch")  # type: ignore[attr-defined]
    assert not p.tool_allowed("fetcher")  # type: ignore[attr-defined]
    assert p.user_allowed(0, [0]) and p.user_allowed(1000, [1000])  # type: ignore[attr-defined]
    assert not p.user_allowed(1001, [1001])  # type: ignore[attr-defined]
    assert p.user_allowed(1002, [65534])  # type: ignore[attr-defined]  # member of nogroup
    nobody = load("[access]\nusers = []")
    assert not nobody.user_allowed(0, [0])  # type: ignore[attr-defined]


def test_the_docs_policy_reference_is_generated_from_the_schema() -> None:
    page = (REPO / "docs/running/policies.md").read_text()
    assert reference_markdown() in page, "run: python scripts/update_doc_references.py"


FIVE_MISTAKES = """
colour = 1
[limits]
memory_mb = 8
pids = "many"
[network]
mode = "internet"
[pool]
min = 9
max = 2
"""


def test_every_mistake_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    """Like ruff or mypy: one run names every problem (file, key path, reason)."""
    with pytest.raises(PolicyError) as info:
        load_policy_text(FIVE_MISTAKES, "/p/five.toml")
    assert [(e.key, e.reason.split(";")[0].split(",")[0]) for e in info.value.errors] == [
        ("colour", "unknown key"),
        ("limits.memory_mb", "must be between 16 and 1048576"),
        ("limits.pids", "must be an integer"),
        ("network.mode", "must be one of none"),
        ("pool.min", "9 is more than pool.max (2)"),
    ]
    assert info.value.message.count("\n") == 4
    path = tmp_path / "five.toml"
    path.write_text(FIVE_MISTAKES)
    out = subprocess.run([sys.executable, "-m", "jaild", "policy", "check", "--offline",
                          str(path)], capture_output=True, text=True, check=False, cwd=REPO)
    assert out.returncode == 1
    assert [line.split(": ")[1] for line in out.stderr.splitlines()] == [
        "colour", "limits.memory_mb", "limits.pids", "network.mode", "pool.min"]


def _two_bad_files(d: Path) -> tuple[Path, Path]:
    d.mkdir()
    (d / "good.toml").write_text("[limits]\nmemory_mb = 64\n")
    first = d / "a.toml"
    first.write_text('[limits]\nmemory_mb = -5\n[python]\nenv = "no-such-env"\n')
    second = d / "b.toml"
    second.write_text("[limits]\nbogus = 1\n")
    return first, second


def test_every_problem_of_every_file_at_once(tmp_path: Path) -> None:
    """A directory with two bad files names both (it once stopped at the first file), and a
    file whose schema fails has its missing env named with its other problems, not after
    they are fixed. Controls: the good file loads; without the host (no envs_dir) no env
    problem is found."""
    first, second = _two_bad_files(tmp_path / "p")
    with pytest.raises(PolicyError) as info:
        load_policy_dir(tmp_path / "p")
    assert [(e.path, e.key) for e in info.value.errors] == [
        (str(first), "limits.memory_mb"), (str(second), "limits.bogus")]
    assert info.value.message.count("\n") == 1
    envs = tmp_path / "envs"
    envs.mkdir()
    files = sorted((tmp_path / "p").glob("*.toml"))
    loaded, offline = check_policy_files(files)
    assert list(loaded) == ["good"] and len(offline) == 2
    loaded, problems = check_policy_files(files, str(envs))
    assert [(Path(e.path).name, e.key) for e in problems] == [
        ("a.toml", "limits.memory_mb"), ("a.toml", "python.env"), ("b.toml", "limits.bogus"),
        ("b.toml", "python.env"), ("good.toml", "python.env")]  # no 'default' env in envs/
    assert problems[1].reason.startswith(f"environment {envs}/no-such-env does not exist")


def test_policy_check_and_serve_say_every_problem_in_one_run(tmp_path: Path) -> None:
    first, second = _two_bad_files(tmp_path / "p")
    state = tmp_path / "state"  # no envs at all: every file's env is a problem too
    (state / "envs").mkdir(parents=True)
    check = subprocess.run([sys.executable, "-m", "jaild", "policy", "check", "--state-dir",
                            str(state), str(first), str(second)],
                           capture_output=True, text=True, check=False, cwd=REPO)
    assert check.returncode == 1
    expected = [[str(first), "limits.memory_mb"], [str(first), "python.env"],
                [str(second), "limits.bogus"], [str(second), "python.env"]]
    assert [line.split(": ")[:2] for line in check.stderr.splitlines()] == expected
    serve = subprocess.run([sys.executable, "-m", "jaild", "serve", "--socket",
                            str(tmp_path / "s.sock"), "--policies", str(tmp_path / "p"),
                            "--state-dir", str(state)],
                           capture_output=True, text=True, check=False, cwd=REPO)
    assert serve.returncode == 1
    said = serve.stderr.splitlines()
    assert said[0] == "jaild: cannot start: invalid policies:", said
    good = str(tmp_path / "p" / "good.toml")
    assert [line.strip().split(": ")[:2] for line in said[1:]] == [*expected, [good, "python.env"]]
    assert not (tmp_path / "s.sock").exists()
