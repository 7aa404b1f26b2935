"""The fail-closed self-test: jaild doctor, and a daemon refusing policies whose jails lie."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.daemon.jails.staging import locate_nsjail
from jaild.errors import PolicyUnavailable
from tests.conftest import STATE_DIR, TEST_POLICIES, DaemonHandle, guard, policy_texts

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]




def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaild", "doctor", "--state-dir", STATE_DIR, *args],
                          capture_output=True, text=True, timeout=guard(300), check=False)


def test_doctor_passes_on_this_host() -> None:
    out = doctor("--policies", str(REPO / "policies"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    for name in ("== host", "== policy default", "== policy strict", "no_new_privs",
                 "uid outside not 0", "seccomp filter mode", "memory limit in force"):
        assert name in out.stdout


def lying_nsjail(directory: Path, extra: str) -> str:
    """An nsjail that quietly weakens every jail (a misconfigured or tampered binary)."""
    script = directory / "nsjail"
    script.write_text(f'#!/bin/sh\nexec {locate_nsjail(None)} "$@" {extra}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_jail_with_the_host_network_is_refused(private_daemon: Callable[..., DaemonHandle],
                                                world_dir: Path) -> None:
    fake = lying_nsjail(world_dir, "--disable_clone_newnet")
    out = doctor("--policies", str(REPO / "policies"), "--nsjail", fake)
    assert out.returncode == 1
    # a zygote policy: the zygote is checked from the host before it may fork a jail
    assert "FAIL  zygote" in out.stdout and "shares the daemon's net namespace" in out.stdout
    d = private_daemon(policy_texts("default", "spawn"), with_repo_policies=False,
                       args=("--nsjail", fake))
    with pytest.raises(PolicyUnavailable, match="shares the daemon's net namespace"):
        d.run("1")
    # a spawn policy: the probe job sees the host's interfaces
    with pytest.raises(PolicyUnavailable, match="no network interfaces: interfaces"):
        d.run("1", policy="spawn")
    with Client(d.socket) as c:
        listed = {p["name"]: p for p in c.policies()}
    assert listed["default"]["available"] is False
    assert listed["spawn"]["available"] is False
    assert "no network interfaces" in listed["spawn"]["problems"]
    shown = subprocess.run([sys.executable, "-m", "jaild", "policies", "--socket", d.socket],
                           capture_output=True, text=True, timeout=guard(60), check=True).stdout
    assert "NOT SERVED: it failed its self-test at start: " in shown
    assert "failed its self-test and will not be served" in d.log()


def test_an_env_that_cannot_harden_is_refused_and_others_still_serve(
        private_daemon: Callable[..., DaemonHandle], world_dir: Path) -> None:
    env = world_dir / "noprctl"
    shutil.copytree(Path(STATE_DIR) / "envs" / "default", env, symlinks=True)
    site = next(env.glob("lib/python3*/site-packages"))
    for f in [*site.glob("prctl*"), *site.glob("_prctl*")]:
        f.unlink()
    d = private_daemon(policies={
        "noprctl": f'[python]\nenv = "{env}"\n',
        "noprctl-spawn": f'[python]\nenv = "{env}"\n[pool]\nmode = "spawn"\n',
        **policy_texts("default"),
    }, with_repo_policies=False)
    with pytest.raises(PolicyUnavailable, match="ModuleNotFoundError: No module named 'prctl'"):
        d.run("1", policy="noprctl")  # its zygote cannot start
    with pytest.raises(PolicyUnavailable, match="runtime did not come up: ModuleNotFoundError"):
        d.run("1", policy="noprctl-spawn")
    d.assert_serving()  # the default policy passed its self-test and serves


def test_a_jail_without_a_user_namespace_is_caught_by_the_host_view(
        private_daemon: Callable[..., DaemonHandle], world_dir: Path) -> None:
    # Without a user namespace of its own the jail lives in the host's, which root owns: its
    # kernel quotas are root's. Only the host can see whose namespace it is.
    fake = lying_nsjail(world_dir, "--disable_clone_newuser")
    d = private_daemon(policy_texts("default", "spawn"), with_repo_policies=False,
                       args=("--nsjail", fake))
    with pytest.raises(PolicyUnavailable, match=r"user namespace not root's: owned by host uids \[0\]"):
        d.run("1", policy="spawn")
    # a zygote policy: caught before any jail is forked (by the zygote itself, first thing)
    with pytest.raises(PolicyUnavailable, match="the zygote is not in a user namespace of its own"):
        d.run("1")


def test_config_file_is_validated(tmp_path: Path) -> None:
    cfg = tmp_path / "jaild.toml"
    cfg.write_text("[limits]\nmax_jobs = 0\n")
    out = subprocess.run([sys.executable, "-m", "jaild", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=guard(60), check=False)
    assert out.returncode == 1
    assert f"{cfg}: limits.max_jobs: must be between 1 and 65536, got 0" in out.stderr
    cfg.write_text("[deamon]\nsocket = '/x'\n")
    out = subprocess.run([sys.executable, "-m", "jaild", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=guard(60), check=False)
    assert f"{cfg}: deamon: unknown key; the config accepts daemon, access, tls, limits" in out.stderr
    assert TEST_POLICIES.exists() and os.path.exists(STATE_DIR)
