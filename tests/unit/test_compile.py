"""The pure policy compiler, checked against golden nsjail configs and command lines.

Regenerate the golden files after an intended change with:
    JAILD_UPDATE_GOLDEN=1 make unit
and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
from pathlib import Path

import pytest

from jaild.policy.compile import (
    JOB_UIDS,
    CgroupLayout,
    HostLayout,
    JobPlacement,
    child_memory_ceiling_bytes,
    job_argv,
    nsjail_config,
    tmp_inodes,
    zygote_argv,
    zygote_memory_mb,
    zygote_request,
)
from jaild.policy.schema import effective_limits, load_policy_dir, load_policy_text

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
POLICIES = load_policy_dir(REPO / "policies")
V1 = HostLayout("/var/lib/jaild/runtime/0123456789abcdef", "/var/lib/jaild/envs", CgroupLayout(1, "jaild"))
V2 = dataclasses.replace(V1, cgroup=CgroupLayout(2, "jaild"))
JOB = JobPlacement("job-00112233aabbccdd", 1073741824, "/proc/self/fd/5", 9)


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("JAILD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with JAILD_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed; review and regenerate if intended"


@pytest.mark.parametrize("name", ["default", "strict"])
def test_nsjail_config_golden(name: str) -> None:
    golden(f"{name}.nsjail.cfg", nsjail_config(POLICIES[name], V1))


@pytest.mark.parametrize(("name", "host", "tag"), [("default", V1, "v1"), ("strict", V1, "v1"),
                                                   ("default", V2, "v2")])
def test_job_argv_golden(name: str, host: HostLayout, tag: str) -> None:
    policy = POLICIES[name]
    argv = job_argv("/usr/bin/nsjail", policy, policy.limits, host, JOB)
    golden(f"{name}.{tag}.argv.json", json.dumps(argv, indent=1) + "\n")


def test_config_invariants() -> None:
    cfg = nsjail_config(POLICIES["default"], V1)
    assert "keep_env: false" in cfg
    assert "time_limit: 0" in cfg  # the daemon enforces wall time
    assert "rlimit_as_type: INF" in cfg
    assert "mount_proc: false" in cfg
    assert 'mount { dst: "/proc" fstype: "proc" options: "subset=pid" rw: false nosuid: true nodev: true noexec: true }' in cfg
    assert 'mount { dst: "/" fstype: "tmpfs"' in cfg and "rw: false" in cfg.split("\n")[31]
    for line in cfg.splitlines():
        if "is_bind: true" in line and "/dev/" not in line:
            assert "rw: false" in line and "nosuid: true" in line and "nodev: true" in line, line
    assert "/sys" not in cfg
    assert "clone_newnet: true" in cfg and "iface_no_lo: true" in cfg
    for ns in ("user", "ns", "pid", "ipc", "uts", "cgroup"):
        assert f"clone_new{ns}: true" in cfg


def test_network_modes() -> None:
    base = "[network]\nmode = '{}'"
    none = nsjail_config(load_policy_text(base.format("none"), "n.toml"), V1)
    loop = nsjail_config(load_policy_text(base.format("loopback"), "n.toml"), V1)
    host = nsjail_config(load_policy_text(base.format("host"), "n.toml"), V1)
    assert "clone_newnet: true" in none and "iface_no_lo: true" in none
    assert "clone_newnet: true" in loop and "iface_no_lo: false" in loop
    assert "clone_newnet: false" in host


def test_proc_modes_and_custom_binds() -> None:
    p = load_policy_text(
        "[filesystem]\nproc = 'none'\nbinds = ['/usr', {src = '/srv/data', dst = '/data'}]", "c.toml"
    )
    cfg = nsjail_config(p, V1)
    assert 'dst: "/proc"' not in cfg
    assert 'mount { src: "/srv/data" dst: "/data" is_bind: true rw: false nosuid: true nodev: true }' in cfg
    full = nsjail_config(load_policy_text("[filesystem]\nproc = 'full'", "f.toml"), V1)
    assert 'mount { dst: "/proc" fstype: "proc" options: "" rw: false' in full


def test_quoting_cannot_inject_config() -> None:
    hostile = '/srv/a" rw: true } mount { src: "/x'
    p = load_policy_text(f"[filesystem]\nbinds = ['/usr', {hostile!r}]".replace('"', '\\"').replace("'", '"'), "q.toml")
    assert p.filesystem.binds[1].src == hostile
    cfg = nsjail_config(p, V1)
    line = next(ln for ln in cfg.splitlines() if "/srv/a" in ln)
    assert line == ('mount { src: "/srv/a\\" rw: true } mount { src: \\"/x" '
                    'dst: "/srv/a\\" rw: true } mount { src: \\"/x" is_bind: true rw: false '
                    'nosuid: true nodev: true }')


def test_per_job_limits_reach_the_argv() -> None:
    policy = POLICIES["default"]
    limits = effective_limits(policy, {"cpu_time_s": 3, "pids": 9, "cpu_cores": 0.5})
    argv = job_argv("/usr/bin/nsjail", policy, limits, V1, JOB)
    joined = " ".join(argv)
    assert "--rlimit_cpu 3" in joined and "--cgroup_pids_max 9" in joined
    assert "--cgroup_cpu_ms_per_sec 500" in joined
    assert "--cgroup_cpu_parent jaild/job-00112233aabbccdd" in joined
    assert "--user 65534:1073741824:1 --group 65534:1073741824:1" in joined


def test_child_cgroup_ceiling_is_above_the_job_limit() -> None:
    assert child_memory_ceiling_bytes(POLICIES["default"]) > 256 << 20


# ---------------------------------------------------------------- the zygote


@pytest.mark.parametrize("name", ["default", "strict"])
def test_zygote_config_golden(name: str) -> None:
    golden(f"{name}.zygote.nsjail.cfg", nsjail_config(POLICIES[name], V1, zygote=True))


@pytest.mark.parametrize(("host", "tag"), [(V1, "v1"), (V2, "v2")])
def test_zygote_argv_golden(host: HostLayout, tag: str) -> None:
    argv = zygote_argv("/usr/bin/nsjail", POLICIES["default"], host, "/proc/self/fd/6", 9,
                       1073741824 + JOB_UIDS, 1073741824)
    golden(f"default.zygote.{tag}.argv.json", json.dumps(argv, indent=1) + "\n")


def test_the_zygote_keeps_capabilities_only_in_its_own_user_namespace() -> None:
    zygote = nsjail_config(POLICIES["default"], V1, zygote=True)
    jail = nsjail_config(POLICIES["default"], V1)
    assert "keep_caps: true" in zygote and "keep_caps" not in jail
    assert "clone_newuser: true" in zygote
    for ns in ("net", "ns", "pid", "ipc", "uts", "cgroup"):
        assert f"clone_new{ns}: true" in zygote
    # the same mounts as a spawned jail, but a full /proc the jails replace with their own
    assert 'dst: "/proc" fstype: "proc" options: ""' in zygote
    assert 'options: "subset=pid"' in jail
    assert "jaild.runtime.zygote" in zygote and "jaild.runtime.main" not in zygote


def test_zygote_uid_map_is_its_own_uid_plus_the_job_range() -> None:
    argv = zygote_argv("/nsjail", POLICIES["default"], V1, "/cfg", 9, 1000 + JOB_UIDS, 1000)
    users = [argv[i + 1] for i, a in enumerate(argv) if a == "--user"]
    groups = [argv[i + 1] for i, a in enumerate(argv) if a == "--group"]
    assert users == groups == [f"0:{1000 + JOB_UIDS}:1", f"1000:1000:{JOB_UIDS}"]


def test_preimport_reaches_the_zygote_command_line() -> None:
    policy = load_policy_text('[pool]\npreimport = ["json", "email.message"]\n', "p.toml")
    cfg = nsjail_config(policy, V1, zygote=True)
    assert 'arg: "json"' in cfg and 'arg: "email.message"' in cfg


def test_zygote_request_matches_what_nsjail_would_set() -> None:
    policy = POLICIES["default"]
    limits = effective_limits(policy, {"memory_mb": 64, "cpu_time_s": 3})
    req = zygote_request(policy, limits, 4242)
    rl = {r: (soft, hard) for r, soft, hard in req["rlimits"]}
    assert rl[resource.RLIMIT_CPU] == (3, 3)
    assert rl[resource.RLIMIT_FSIZE] == (policy.limits.file_size_mb << 20,) * 2
    assert rl[resource.RLIMIT_NOFILE] == (policy.limits.open_files,) * 2
    assert rl[resource.RLIMIT_CORE] == (0, 0)
    assert req["uid"] == 4242 and req["hostname"] == "jail"
    assert req["proc"] == "pid-only" and req["netns"] and not req["loopback"]
    assert f"nr_inodes={tmp_inodes(policy.filesystem.tmp_mb)}" in req["tmp"]
    host = load_policy_text('[network]\nmode = "host"\n[filesystem]\nshm_mb = 0\n', "h.toml")
    req = zygote_request(host, host.limits, 1)
    assert not req["netns"] and req["shm"] == ""


def test_the_zygote_cgroup_has_room_for_jails_in_transit() -> None:
    # pages a jail touches before it is moved to its job's cgroup stay charged to the zygote's
    policy = POLICIES["default"]
    cfg = nsjail_config(policy, V1, zygote=True, max_jobs=100)
    assert f"cgroup_mem_max: {(2 * policy.limits.memory_mb + 100) << 20}" in cfg
    assert zygote_memory_mb(policy, 100) == 2 * policy.limits.memory_mb + 100


def test_only_pooled_jails_warm_up() -> None:
    policy = POLICIES["default"]
    assert zygote_request(policy, policy.limits, 1, pooled=True)["warm_up"] is True
    assert zygote_request(policy, policy.limits, 1)["warm_up"] is False
