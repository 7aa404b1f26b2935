"""``jaild env``: names, requirements digests, manifests, immutability, listing, arguments.

Fast and offline: nothing here runs pip. Building real envs is tests/integration/test_envs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild import envs
from jaild.cli import main
from jaild.envs import (
    MANIFEST,
    RUNTIME_REQUIREMENTS,
    BuildRequest,
    EnvError,
    EnvUsageError,
    Manifest,
    build_env,
    check_name,
    env_digest,
    inspect_python,
    list_envs,
    resolve_requirements,
    runtime_requirements_text,
)
from jaild.errors import PolicyError
from jaild.policy.schema import host_checks, load_policy_text
from tests.conftest import world_tempdir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def state() -> Iterator[Path]:
    """A state directory the jailed uid could reach (pytest's tmp_path sits in a 0700 dir)."""
    d = world_tempdir("jaild-test-envs-")
    yield d
    for root, dirs, _files in os.walk(d):  # sealed trees: give write permission back
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    shutil.rmtree(d)


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def fake_env(envs_dir: Path, name: str, manifest: Manifest | None = None,
             packages: tuple[str, ...] = ("msgpack", "numpy")) -> Path:
    """A venv-shaped directory (no interpreter run): pyvenv.cfg, dist-info dirs, a manifest."""
    env = envs_dir / name
    site = env / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    for p in (*packages, "pip"):
        (site / f"{p}-1.0.dist-info").mkdir()
    (env / "bin").mkdir()
    (env / "bin" / "python3").symlink_to("/usr/bin/python3")
    if manifest is not None:
        (env / MANIFEST).write_text(manifest.to_json())
    return env


def manifest_for(name: str, requirements: str, built_at: str = "2025-01-02T03:04:05Z") -> Manifest:
    python = inspect_python("/usr/bin/python3")
    return Manifest(
        name=name,
        python=python.path,
        python_realpath=python.realpath,
        python_version=python.version,
        requirements_file=requirements,
        requirements=Path(requirements).read_text(),
        requirements_sha256=env_digest(runtime_requirements_text(),
                                       resolve_requirements(requirements)),
        packages=("msgpack==1.2.4", "tinypkg==0.1"),
        built_at=built_at,
        builder="jaild 0.1.0",
    )


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["default", "data", "a", "py3.11-numpy_2", "X" * 64])
def test_valid_names(name: str) -> None:
    assert check_name(name) == name
    # the same rule as a policy's python.env
    load_policy_text(f'[python]\nenv = "{name}"\n', "/etc/jaild/policies/p.toml")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "it is empty"),
        (".hidden", "it starts with '.'"),
        ("-x", "it starts with '-'"),
        ("a/b", "it contains '/'"),
        ("../etc", "it starts with '.'"),
        ("a b", "it contains ' '"),
        ("é", "it starts with 'é'"),
        ("x" * 65, "it has 65 characters (at most 64)"),
    ],
)
def test_invalid_names_say_what_is_wrong(name: str, problem: str) -> None:
    with pytest.raises(EnvUsageError) as info:
        check_name(name)
    assert info.value.message.startswith(f"invalid environment name {name!r}: {problem}; ")
    assert info.value.exit_code == 2
    # ... and a policy would refuse the name too
    with pytest.raises(PolicyError):
        load_policy_text(f"[python]\nenv = {json.dumps(name)}\n", "/etc/jaild/policies/p.toml")


# ---------------------------------------------------------------------------- requirements


def test_runtime_requirements_match_envs_default_txt() -> None:
    """One source of truth: the constant used outside a checkout is envs/default.txt's."""
    text = (REPO / "envs" / "default.txt").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert tuple(lines) == RUNTIME_REQUIREMENTS
    assert runtime_requirements_text() == text


def test_the_digest_covers_included_files(tmp_path: Path) -> None:
    write(tmp_path / "base.txt", "msgpack>=1.0.5\n")
    top = write(tmp_path / "sub" / "top.txt", "# numbers\n-r ../base.txt\nnumpy>=1.26\n")
    runtime = runtime_requirements_text()
    resolved = resolve_requirements(top)
    assert resolved.files == (top, str(tmp_path / "sub" / "../base.txt"))
    assert resolved.text == (
        "# numbers\n# begin -r ../base.txt\nmsgpack>=1.0.5\n# end -r ../base.txt\nnumpy>=1.26\n"
    )
    assert resolved.canonical == "# -r ../base.txt\nmsgpack>=1.0.5\nnumpy>=1.26\n"
    before = env_digest(runtime, resolved)
    write(tmp_path / "base.txt", "msgpack>=1.0.6\n")  # only the included file changes
    assert env_digest(runtime, resolve_requirements(top)) != before
    write(tmp_path / "base.txt", "msgpack>=1.0.5\n")
    assert env_digest(runtime, resolve_requirements(top)) == before
    # comments, blank lines and spacing do not call for a rebuild
    write(tmp_path / "sub" / "top.txt", "\n-r ../base.txt   # the base\n\nnumpy>=1.26  \n")
    assert env_digest(runtime, resolve_requirements(top)) == before
    # the runtime's needs are part of it
    assert env_digest(runtime + "extra\n", resolve_requirements(top)) != before


def test_data_txt_includes_default_txt() -> None:
    resolved = resolve_requirements(str(REPO / "envs" / "data.txt"))
    assert [Path(f).name for f in resolved.files] == ["data.txt", "default.txt"]
    for req in ("msgpack", "pyseccomp", "python-prctl", "numpy", "pandas"):
        assert req in resolved.canonical


@pytest.mark.parametrize("spelling", ["-r base.txt", "-rbase.txt", "--requirement base.txt",
                                      "--requirement=base.txt", "-c base.txt",
                                      "--constraint=base.txt"])
def test_include_spellings(tmp_path: Path, spelling: str) -> None:
    write(tmp_path / "base.txt", "msgpack==1.0.8\n")
    top = write(tmp_path / "top.txt", f"{spelling}\n")
    assert "msgpack==1.0.8" in resolve_requirements(top).canonical


def test_url_includes_and_options_are_kept_as_written(tmp_path: Path) -> None:
    top = write(tmp_path / "top.txt",
                "--find-links ./wheels\n-r https://example.org/req.txt\n--require-hashes\n")
    assert resolve_requirements(top).canonical == (
        "--find-links ./wheels\n-r https://example.org/req.txt\n--require-hashes\n"
    )


def test_requirements_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(EnvUsageError, match=r"requirements: .*/nope.txt does not exist"):
        resolve_requirements(str(tmp_path / "nope.txt"))
    top = write(tmp_path / "top.txt", "-r missing.txt\n")
    with pytest.raises(EnvUsageError, match=r"top.txt: -r missing.txt: .*missing.txt does not exist"):
        resolve_requirements(top)
    write(tmp_path / "a.txt", "-r b.txt\n")
    write(tmp_path / "b.txt", "-r a.txt\n")
    with pytest.raises(EnvUsageError, match="which includes it again"):
        resolve_requirements(str(tmp_path / "a.txt"))
    with pytest.raises(EnvUsageError, match="is a directory"):
        resolve_requirements(str(tmp_path))


def test_credentials_in_urls_are_redacted() -> None:
    text = "--index-url https://user:s3cret@pypi.example/simple\npkg @ git+https://tok@gh/x.git\n"
    assert envs.redact(text) == (
        "--index-url https://***@pypi.example/simple\npkg @ git+https://***@gh/x.git\n"
    )


# ---------------------------------------------------------------------------- the interpreter


def test_the_interpreter_must_be_a_system_one(tmp_path: Path) -> None:
    python = inspect_python("/usr/bin/python3")
    assert python.realpath.startswith("/usr/")
    assert python.abi == f"{sys.version_info[0]}.{sys.version_info[1]}"
    # a venv's interpreter (this test suite's own) resolves into /usr but is refused
    if sys.prefix != sys.base_prefix:
        with pytest.raises(EnvUsageError, match=r"is the interpreter of the venv .* Use the system"):
            inspect_python(sys.executable)
    outside = tmp_path / "python3"
    outside.write_text("#!/bin/sh\nexit 0\n")
    outside.chmod(0o755)
    with pytest.raises(EnvUsageError, match=r"resolves to .*, which jails cannot see"):
        inspect_python(str(outside))
    with pytest.raises(EnvUsageError, match="no such executable"):
        inspect_python("/usr/bin/no-such-python")


# ---------------------------------------------------------------------------- manifests


def test_manifest_round_trip_and_unknown_fields(tmp_path: Path) -> None:
    m = manifest_for("tiny", write(tmp_path / "r.txt", "tinypkg\n"))
    assert Manifest.from_json(m.to_json()) == m
    data = json.loads(m.to_json())
    assert set(data) >= {"name", "python", "python_version", "requirements", "requirements_sha256",
                         "packages", "built_at", "builder"}
    data["added_later"] = 1
    assert Manifest.from_json(json.dumps(data)) == m
    assert envs.read_manifest(str(tmp_path)) is None
    (tmp_path / MANIFEST).write_text("{not json")
    assert envs.read_manifest(str(tmp_path)) is None


# ---------------------------------------------------------------------------- immutability


def test_an_existing_env_is_refused_without_rebuild(state: Path, tmp_path: Path) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    fake_env(state / "envs", "tiny", manifest_for("tiny", req))
    with pytest.raises(EnvError) as info:
        build_env(BuildRequest("tiny", req, state_dir=str(state)))
    assert info.value.message == (
        "environment tiny exists (built 2025-01-02T03:04:05Z); environments are immutable: "
        "rebuild with --rebuild"
    )
    assert info.value.exit_code == 1
    fake_env(state / "envs", "byhand")
    with pytest.raises(EnvError, match=r"environment byhand exists \(built by hand: no manifest\)"):
        build_env(BuildRequest("byhand", req, state_dir=str(state)))


def test_a_rebuild_with_the_same_requirements_is_a_no_op(state: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    env = fake_env(state / "envs", "tiny", manifest_for("tiny", req))
    before = (env / MANIFEST).read_text()

    def no_build(*args: object) -> None:
        raise AssertionError("an up-to-date env was rebuilt")

    monkeypatch.setattr(envs, "_build_into", no_build)
    assert build_env(BuildRequest("tiny", req, state_dir=str(state), rebuild=True)) == (
        str(env), None)
    write(tmp_path / "r.txt", "# a comment only\ntinypkg\n")
    assert build_env(BuildRequest("tiny", req, state_dir=str(state), rebuild=True))[1] is None
    assert (env / MANIFEST).read_text() == before
    # a changed requirement, or --force, does rebuild
    write(tmp_path / "r.txt", "tinypkg==0.2\n")
    with pytest.raises(AssertionError, match="was rebuilt"):
        build_env(BuildRequest("tiny", req, state_dir=str(state), rebuild=True))
    write(tmp_path / "r.txt", "tinypkg\n")
    with pytest.raises(AssertionError, match="was rebuilt"):
        build_env(BuildRequest("tiny", req, state_dir=str(state), rebuild=True, force=True))


def test_a_failed_build_leaves_nothing_and_the_old_env_untouched(
        state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    env = fake_env(state / "envs", "tiny")  # no manifest: a rebuild is due
    before = sorted(p.name for p in env.rglob("*"))

    def failing_build(work: str, *args: object) -> None:
        Path(work, "bin").mkdir(parents=True)
        Path(work, "half-done").write_text("")
        raise EnvError("pip could not install ...")

    monkeypatch.setattr(envs, "_build_into", failing_build)
    with pytest.raises(EnvError, match="pip could not install"):
        build_env(BuildRequest("tiny", req, state_dir=str(state), rebuild=True))
    assert sorted(p.name for p in env.rglob("*")) == before
    assert sorted(p.name for p in (state / "envs").iterdir()) == [".jaild-envs.lock", "tiny"]


def test_swap_replaces_and_removes_the_old_tree(state: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    envs_dir = state / "envs"
    for exchange in (True, False):  # renameat2(RENAME_EXCHANGE), and two renames without it
        if not exchange:
            monkeypatch.setattr(envs, "_renameat2_exchange", lambda a, b: False)
        old = fake_env(envs_dir, "tiny", packages=("old",))
        envs.set_modes(str(old), writable=False)
        new = fake_env(envs_dir, ".tiny.build-1", packages=("new",))
        envs.set_modes(str(new), writable=False)
        envs._swap_in(str(new), str(envs_dir / "tiny"), "tiny", sys.stderr)
        assert sorted(p.name for p in envs_dir.iterdir()) == ["tiny"]
        assert (envs_dir / "tiny/lib/python3.11/site-packages/new-1.0.dist-info").is_dir()
        envs.remove_tree(str(envs_dir / "tiny"))


def test_sealing_makes_a_tree_read_only_and_world_readable(state: Path) -> None:
    env = fake_env(state, "tiny")
    (env / "bin" / "tool").write_text("#!/bin/sh\n")
    (env / "bin" / "tool").chmod(0o700)
    (env / "secret").write_text("x")
    (env / "secret").chmod(0o600)
    target = state / "outside"
    target.write_text("")
    target.chmod(0o600)
    (env / "link").symlink_to(target)
    envs.set_modes(str(env), writable=False)
    assert stat.S_IMODE((env / "bin" / "tool").stat().st_mode) == 0o555
    assert stat.S_IMODE((env / "secret").stat().st_mode) == 0o444
    assert stat.S_IMODE(env.stat().st_mode) == 0o555
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # a link's target is left alone
    envs.remove_tree(str(env))
    assert not env.exists() and target.exists()


def test_a_state_dir_the_jailed_uid_cannot_reach_is_refused(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    req = write(tmp_path / "r.txt", "tinypkg\n")
    with pytest.raises(EnvError, match=r"is not world-searchable, so the jailed uid could not"):
        build_env(BuildRequest("tiny", req, state_dir=str(closed / "state")))


def test_missing_state_dirs_are_made_0755_whatever_the_umask(state: Path) -> None:
    old = os.umask(0o077)
    try:
        envs_dir = envs._prepare_envs_dir(str(state / "a" / "b"))
    finally:
        os.umask(old)
    assert envs_dir == f"{state}/a/b/envs"
    for d in (state / "a", state / "a" / "b", state / "a" / "b" / "envs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, d


def test_no_permission_says_what_to_do(state: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "mkdir", denied)
    req = write(tmp_path / "r.txt", "tinypkg\n")
    with pytest.raises(EnvError, match=rf"cannot create {state}/new: permission denied\. The "
                                       r"system state directory needs root .*--state-dir DIR"):
        build_env(BuildRequest("tiny", req, state_dir=str(state / "new")))


# ---------------------------------------------------------------------------- list


def test_list_shows_envs_their_policies_and_what_is_missing(state: Path, tmp_path: Path) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    fake_env(state / "envs", "tiny", manifest_for("tiny", req))
    fake_env(state / "envs", "byhand", packages=("a", "b", "c"))
    (state / "envs" / ".tiny.old-20250101T000000-1").mkdir()
    pdir = tmp_path / "policies"
    write(pdir / "small.toml", '[python]\nenv = "tiny"\n')
    write(pdir / "also.toml", f'[python]\nenv = "{state}/envs/tiny"\n')
    write(pdir / "ghostly.toml", '[python]\nenv = "ghost"\n')
    listing = list_envs(str(state), str(pdir))
    got = {e.name: e.to_dict() for e in listing.envs}
    assert list(got) == ["byhand", "tiny"]
    assert got["tiny"]["policies"] == ["also", "small"]
    assert got["tiny"]["packages"] == 2 and got["tiny"]["python_version"] == "3.11.2"
    assert got["tiny"]["has_manifest"] and got["tiny"]["size_bytes"] > 0
    assert got["byhand"] == got["byhand"] | {"has_manifest": False, "packages": 3,
                                             "python_version": "3.11.2", "policies": []}
    assert [m.to_dict() for m in listing.missing] == [
        {"policy": "ghostly", "file": str(pdir / "ghostly.toml"), "env": f"{state}/envs/ghost"}
    ]
    text = envs.format_listing(listing)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:3]}
    assert rows["tiny"][1:3] == ["3.11.2", "2"]
    assert rows["tiny"][5:] == ["2025-01-02T03:04:05Z", listing.envs[1].manifest.requirements_sha256[:12],  # type: ignore[union-attr]
                                "also,", "small"]
    assert rows["byhand"][1:3] == ["3.11.2", "3"] and rows["byhand"][5:7] == ["no", "manifest"]
    assert "note: byhand has no manifest" in text
    assert f"missing: policy ghostly ({pdir}/ghostly.toml) uses {state}/envs/ghost" in text
    assert "jaild env build ghost -r requirements.txt" in text
    assert f"replaced: {state}/envs/.tiny.old-20250101T000000-1, kept while jails use it" in text


def test_list_json_and_a_broken_policy_dir(state: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "list", "--state-dir", str(state), "--policies", str(tmp_path / "no"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["envs"] == [] and out["missing"] == []
    assert "policy directory does not exist" in out["policies_error"]
    assert main(["env", "list", "--state-dir", str(state), "--policies", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"no environments in {state}/envs" in text
    assert "warning: policies not loaded" in text


def test_the_missing_env_message_names_the_fix() -> None:
    p = load_policy_text('[python]\nenv = "ghost"\n', "/etc/jaild/policies/p.toml")
    [problem] = [e.message for e in host_checks(p, "/var/lib/jaild-nowhere/envs")]
    assert problem == (
        "/etc/jaild/policies/p.toml: python.env: environment /var/lib/jaild-nowhere/envs/ghost "
        "does not exist; build it: jaild env build ghost -r requirements.txt --state-dir "
        "/var/lib/jaild-nowhere (or point python.env at a venv)"
    )
    p = load_policy_text('[python]\nenv = "/opt/nowhere/env"\n', "/etc/jaild/policies/p.toml")
    [problem] = [e.message for e in host_checks(p, "/var/lib/jaild-nowhere/envs")]
    assert "jaild env build NAME -r requirements.txt) and set python.env = NAME" in problem


# ---------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["env", "build", "bad/name", "-r", "{req}"], "invalid environment name 'bad/name'"),
        (["env", "build", "tiny", "-r", "{tmp}/nope.txt"], "nope.txt does not exist"),
        (["env", "build", "tiny", "-r", "{req}", "--force"], "--force only applies with --rebuild"),
        (["env", "build", "tiny", "-r", "{req}", "--python", "/usr/bin/nope"],
         "--python /usr/bin/nope: no such executable"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, state: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    argv = [a.format(req=req, tmp=tmp_path) for a in argv]
    assert main([*argv, "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaild: ") and message in err
    assert not (state / "envs" / "tiny").exists()


@pytest.mark.parametrize("argv", [["env"], ["env", "build", "tiny"], ["env", "list", "extra"],
                                  ["env", "frobnicate"]])
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_an_existing_env_exits_1(state: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    req = write(tmp_path / "r.txt", "tinypkg\n")
    fake_env(state / "envs", "tiny", manifest_for("tiny", req))
    assert main(["env", "build", "tiny", "-r", req, "--state-dir", str(state)]) == 1
    assert "environments are immutable: rebuild with --rebuild" in capsys.readouterr().err
    assert main(["env", "build", "tiny", "-r", req, "--state-dir", str(state), "--rebuild"]) == 0
    assert capsys.readouterr().out == f"tiny: up to date ({state}/envs/tiny)\n"
