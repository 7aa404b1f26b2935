"""``jaild env build`` for real, used by real jails; and the shipped ``data`` policy.

The env is built into a private state directory (under /var/tmp: the jailed uid must be able
to traverse it) from a one-module wheel made here, plus the runtime's packages through pip
and its cache -- exactly what ``make jail-env`` does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonHandle, guard, require_jail_host

pytestmark = pytest.mark.integration

TINY = "jaild_envtest_tiny"  # an importable name nobody publishes
TINY_DIST = "jaild-envtest-tiny"


def make_wheel(directory: Path, version: str = "0.1") -> Path:
    """A pure-Python wheel of one module, written directly (no build backend, no network)."""
    dist_info = f"{TINY}-{version}.dist-info"
    files = {
        f"{TINY}/__init__.py": f"VALUE = 42\nVERSION = {version!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {TINY_DIST}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: jaild-tests\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    wheel = directory / f"{TINY}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def jaild_env(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaild", "env", *args], capture_output=True,
                          text=True, timeout=guard(600), check=False)


def unseal_and_remove(path: Path) -> None:
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """State directory and wheelhouse, reachable by the jailed uid."""
    require_jail_host()
    d = Path(tempfile.mkdtemp(prefix="jaild-test-envs-", dir="/var/tmp"))
    d.chmod(0o755)
    (d / "wheels").mkdir()
    make_wheel(d / "wheels")
    (d / "requirements.txt").write_text(f"--find-links ./wheels\n{TINY_DIST}==0.1\n")
    yield d
    unseal_and_remove(d)


@pytest.fixture(scope="module")
def tiny(scratch: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The env ``tiny``: the runtime's packages plus the one-module wheel."""
    out = jaild_env("build", "tiny", "-r", str(scratch / "requirements.txt"),
                    "--state-dir", str(scratch / "state"))
    assert out.returncode == 0, out.stdout + out.stderr
    return scratch / "state" / "envs" / "tiny", out


def tiny_policy(pool: str = "") -> dict[str, str]:
    return {"tiny": f'[python]\nenv = "tiny"\n[pool]\nmin = 0\nmax = 1\n{pool}'}


def test_build_makes_a_sealed_env_with_a_manifest(scratch: Path,
                                                  tiny: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    env, out = tiny
    for phase in ("[1/4] tiny: creating venv from /usr/bin/python3",
                  "[2/4] tiny: installing", "[3/4] tiny: checking the jail runtime's imports",
                  "[4/4] tiny: sealing"):
        assert phase in out.stderr
    assert "Successfully installed" in out.stderr  # pip's own output, streamed
    assert out.stdout.startswith(f"tiny: built {env} (Python 3.")

    manifest = json.loads((env / ".jaild-env.json").read_text())
    assert manifest["name"] == "tiny" and manifest["python"] == "/usr/bin/python3"
    assert manifest["python_realpath"].startswith("/usr/")
    assert f"{TINY_DIST}==0.1" in manifest["packages"]
    names = {p.split("==")[0].lower() for p in manifest["packages"]}
    assert {"msgpack", "pyseccomp", "python-prctl"} <= names
    assert len(manifest["requirements_sha256"]) == 64
    assert manifest["requirements"] == (scratch / "requirements.txt").read_text()
    assert manifest["builder"].startswith("jaild ")

    # world-readable, sealed; bin/python3 is the system interpreter
    assert os.path.realpath(env / "bin" / "python3").startswith("/usr/")
    for root, dirs, files in os.walk(env):
        for name in [*dirs, *files, ""]:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            assert st.st_mode & 0o222 == 0, path
            assert st.st_mode & 0o004, path
            if stat.S_ISDIR(st.st_mode):
                assert st.st_mode & 0o001, path
    # the build left nothing else behind
    assert sorted(p.name for p in env.parent.iterdir()) == [".jaild-envs.lock", "tiny"]

    # immutable: a second build is refused, a rebuild of the same requirements does nothing
    again = jaild_env("build", "tiny", "-r", str(scratch / "requirements.txt"),
                      "--state-dir", str(scratch / "state"))
    assert again.returncode == 1
    assert "environment tiny exists (built " in again.stderr
    assert "environments are immutable: rebuild with --rebuild" in again.stderr
    same = jaild_env("build", "tiny", "-r", str(scratch / "requirements.txt"),
                     "--state-dir", str(scratch / "state"), "--rebuild")
    assert (same.returncode, same.stdout) == (0, f"tiny: up to date ({env})\n"), same.stderr

    listed = json.loads(jaild_env("list", "--state-dir", str(scratch / "state"),
                                  "--policies", str(REPO / "policies"), "--json").stdout)
    [entry] = listed["envs"]
    assert entry["name"] == "tiny" and entry["has_manifest"]
    assert entry["packages"] == len(manifest["packages"]) and entry["size_bytes"] > 1_000_000
    assert entry["policies"] == []
    assert {m["policy"] for m in listed["missing"]} >= {"default", "strict"}


def test_a_failed_build_changes_nothing(scratch: Path,
                                        tiny: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    env, _ = tiny
    before = (env / ".jaild-env.json").read_text()
    broken = scratch / "broken.txt"
    broken.write_text("--no-index\n--find-links ./wheels\njaild-no-such-package==9.9\n")
    out = jaild_env("build", "tiny", "-r", str(broken), "--state-dir", str(scratch / "state"),
                    "--rebuild")
    assert out.returncode == 1
    assert "jaild: pip could not install the requirements of tiny (exit status 1); nothing was " \
           "changed. The end of pip's output:" in out.stderr
    assert "No matching distribution found" in out.stderr.split("The end of pip's output:")[1]
    assert (env / ".jaild-env.json").read_text() == before
    assert sorted(p.name for p in env.parent.iterdir()) == [".jaild-envs.lock", "tiny"]


def test_the_env_works_in_a_jail_and_a_running_daemon_keeps_it(
        scratch: Path, tiny: tuple[Path, subprocess.CompletedProcess[str]],
        private_daemon: Callable[..., DaemonHandle]) -> None:
    env, _ = tiny
    state = str(scratch / "state")
    d = private_daemon(tiny_policy(f'preimport = ["{TINY}"]\n'), with_repo_policies=False,
                       args=("--state-dir", state))
    probe = f"import sys, {TINY}\n({TINY}.VALUE, {TINY}.__file__.startswith(sys.prefix))"
    r = d.run(probe, policy="tiny")
    assert (r.status, r.result) == ("ok", [42, True]), (r.status, r.error)

    # Rebuilt under a running daemon: the new tree is swapped in; the zygote keeps the one it
    # mounted, which is kept (not removed) while it is mounted.
    out = jaild_env("build", "tiny", "-r", str(scratch / "requirements.txt"), "--state-dir",
                    state, "--rebuild", "--force", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "the replaced env is still mounted by running jails" in out.stderr
    [old] = [p for p in env.parent.iterdir() if p.name.startswith(".tiny.old-")]
    assert (old / ".jaild-env.json").is_file()
    r = d.run(probe, policy="tiny")
    assert (r.status, r.result) == ("ok", [42, True]), (r.status, r.error)
    listed = json.loads(jaild_env("list", "--state-dir", state, "--json").stdout)
    assert listed["retired"][0]["path"] == str(old) and listed["retired"][0]["mounted_by"] >= 1

    # Once the daemon is gone, the next build (here a no-op rebuild) removes it.
    assert d.stop() == 0
    out = jaild_env("build", "tiny", "-r", str(scratch / "requirements.txt"), "--state-dir",
                    state, "--rebuild")
    assert out.returncode == 0 and "up to date" in out.stdout, out.stderr
    assert f"removed {old}" in out.stderr
    assert sorted(p.name for p in env.parent.iterdir()) == [".jaild-envs.lock", "tiny"]


def test_a_daemon_refuses_a_policy_naming_a_missing_env(
        scratch: Path, tiny: tuple[Path, subprocess.CompletedProcess[str]],
        private_daemon: Callable[..., DaemonHandle]) -> None:
    state = scratch / "state"
    d = private_daemon({"absent": '[python]\nenv = "absent"\n'}, with_repo_policies=False,
                       args=("--state-dir", str(state)), wait=False)
    assert d.proc.wait(guard(60)) == 1
    assert (f"{d.policies_dir}/absent.toml: python.env: environment {state}/envs/absent does "
            f"not exist; build it: jaild env build absent -r requirements.txt --state-dir "
            f"{state} (or point python.env at a venv)") in d.log()
    assert not os.path.exists(d.socket)


# ---------------------------------------------------------------------------- policies/data.toml

DATA_JOB = """
import os, sys
preimported = "numpy" in sys.modules and "pandas" in sys.modules
import numpy as np
import pandas as pd
n = 1_000_000
df = pd.DataFrame({"k": np.arange(n) % 7, "v": np.arange(n, dtype=np.float64)})
sums = df.groupby("k")["v"].sum()
big = np.ones(75_000_000)  # 600 MB touched: over the default policy's 256 MB, under 1024
(preimported, int(sums.loc[3]), float(big.sum()), os.environ["OMP_NUM_THREADS"],
 len(os.listdir("/proc/self/task")))
"""


def test_the_shipped_data_policy(private_daemon: Callable[..., DaemonHandle]) -> None:
    # the shipped file itself (tests/policies/data.toml would replace it in start_daemon's copy)
    d = private_daemon({"data": (REPO / "policies" / "data.toml").read_text()},
                       with_repo_policies=False)
    with d.client() as c:
        deadline = time.monotonic() + guard(30)
        while {p["name"]: p for p in c.policies()}["data"]["pool"]["ready"] < 1:
            assert time.monotonic() < deadline, "the data pool never filled"
            time.sleep(0.1)
        r = c.run(DATA_JOB, "data", timeout=60)
        assert r.status == "ok", (r.status, r.error, r.stderr)
        expected_sum = float(sum(range(3, 1_000_000, 7)))
        # a pooled jail, forked from a zygote that pre-imported numpy and pandas; one thread
        assert r.result == [True, expected_sum, 75_000_000.0, "1", 1]
        assert r.limits["memory_mb"] == 1024
        assert r.limits["wall_time_s"] == 60 and r.limits["cpu_time_s"] == 60
        pool = {p["name"]: p for p in c.policies()}["data"]["pool"]
        assert pool["hits"] >= 1 and pool["max"] == 2
        # and the limit holds: 1.6 GB of touched pages end in memory_limit
        r = c.run("import numpy as np\na = np.ones(200_000_000)\nfloat(a.sum())", "data",
                  timeout=60)  # the policy's own wall time (a job may not loosen it)
        assert r.status == "memory_limit", (r.status, r.error)
