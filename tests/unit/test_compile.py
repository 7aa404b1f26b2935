"""The pure policy compiler, checked against golden nsjail configs and command lines.

Regenerate the golden files after an intended change with:
    JAILD_UPDATE_GOLDEN=1 make unit
and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from jaild.policy.compile import (
    JAIL_HOSTNAME,
    JAIL_MEMLOCK_BYTES,
    JAIL_MSGQUEUE_BYTES,
    JAIL_SIGPENDING,
    JAIL_UID,
    JOB_UIDS,
    WORKDIR,
    CgroupLayout,
    HostLayout,
    IdMap,
    JailPlan,
    JobFacts,
    JobPlacement,
    child_memory_ceiling_bytes,
    compile_policy,
    compile_zygote,
    forked_jail,
    job_argv,
    nsjail_config,
    render_config,
    render_mount,
    tmp_inodes,
    zygote_argv,
    zygote_memory_mb,
)
from jaild.policy.schema import Policy, effective_limits, load_policy_dir, load_policy_text
from jaild.protocol.zygote_link import JailSetup, Mount, Rlimits

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


def test_the_zygote_cgroup_has_room_for_jails_in_transit() -> None:
    # pages a jail touches before it is moved to its job's cgroup stay charged to the zygote's
    policy = POLICIES["default"]
    cfg = nsjail_config(policy, V1, zygote=True, max_jobs=100)
    assert f"cgroup_mem_max: {(2 * policy.limits.memory_mb + 100) << 20}" in cfg
    assert zygote_memory_mb(policy, 100) == 2 * policy.limits.memory_mb + 100




# ---------------------------------------------------------------- the plan


SHIPPED = sorted(POLICIES)
JOB_UID = 1073741824 + 7


def job_plans(policy: Policy) -> dict[str, JailPlan]:
    """Every plan the daemon makes of ``policy``'s jails."""
    job = JobFacts(policy.limits, JOB_UID)
    return {
        "policy": compile_policy(policy, V1),
        "spawned": compile_policy(policy, V1, job),
        "forked": compile_policy(policy, V1, job, forked=True),
        "zygote": compile_zygote(policy, V1, uids=(JOB_UID + JOB_UIDS, 1073741824)),
    }


def test_every_policy_is_shipped_with_a_plan() -> None:
    assert SHIPPED == ["data", "default", "strict", "web"]


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_of_each_shipped_policy(name: str) -> None:
    policy = POLICIES[name]
    fs, lim = policy.filesystem, policy.limits
    plan = compile_policy(policy, V1, JobFacts(lim, JOB_UID))
    jail = plan.jail
    assert plan.name == name and plan.seccomp == policy.seccomp_choice
    assert (jail.hostname, jail.cwd, jail.uid) == (JAIL_HOSTNAME, WORKDIR, JAIL_UID)
    assert plan.id_maps == (IdMap(JAIL_UID, JOB_UID, 1),)
    assert jail.rlimits == Rlimits(lim.cpu_time_s, lim.file_size_mb << 20, lim.open_files, 0,
                                   JAIL_SIGPENDING, JAIL_MSGQUEUE_BYTES, JAIL_MEMLOCK_BYTES)
    assert plan.pids_max == lim.pids and not plan.keep_caps
    assert plan.memory_max_bytes == child_memory_ceiling_bytes(policy)
    assert set(jail.namespaces) >= {"user", "mount", "pid", "ipc", "uts", "cgroup"}
    assert ("net" in jail.namespaces) == (policy.network.mode != "host")
    assert jail.loopback == (policy.network.mode in ("loopback", "egress"))
    # the root is an empty read-only tmpfs; every bind is read-only, nosuid, nodev
    root = plan.mounts[0]
    assert (root.target, root.kind, root.writable) == ("/", "tmpfs", False)
    for mount in plan.mounts:
        if mount.kind == "bind" and not mount.target.startswith("/dev/"):
            assert not mount.writable and mount.nosuid and mount.nodev, mount
    # writable: /tmp, /dev/shm (if any), /dev/null -- nothing else
    writable = [m.target for m in plan.mounts if m.writable]
    assert writable == ["/tmp", *(["/dev/shm"] if fs.shm_mb else []), "/dev/null"]
    for mount in jail.mounts:  # the jail's own: no setuid, devices or programs from there
        assert mount.nosuid and mount.nodev and mount.noexec, mount
    tmp = jail.mounts[0]
    assert tmp.options == f"size={fs.tmp_mb << 20},mode=1777,nr_inodes={tmp_inodes(fs.tmp_mb)}"
    procs = [m for m in plan.mounts if m.kind == "proc"]
    assert [m.options for m in procs] == {"none": [], "pid-only": ["subset=pid"], "full": [""]}[
        fs.proc
    ]
    assert plan.program[-1].endswith("from jaild.runtime.main import main;main()")


@pytest.mark.parametrize("name", SHIPPED)
def test_a_forked_jail_is_the_spawned_jail_made_by_its_zygote(name: str) -> None:
    """The zygote's frame plus the forked jail's own mounts are the spawned jail's mounts;
    only who makes them, and the uid the jail runs as, differ."""
    plans = job_plans(POLICIES[name])
    spawned, forked, zygote = plans["spawned"], plans["forked"], plans["zygote"]
    assert forked.mounts == spawned.mounts
    assert zygote.frame == spawned.frame and zygote.devices == spawned.devices
    # the jail detaches exactly the zygote's own fresh mounts
    assert forked.jail.detach == tuple(m.target for m in zygote.jail.mounts)
    assert forked.jail.uid == JOB_UID and forked.id_maps == ()
    assert set(forked.jail.namespaces) == set(spawned.jail.namespaces) - {"user"}
    same = ("hostname", "cwd", "mounts", "rlimits", "loopback")
    assert [getattr(forked.jail, f) for f in same] == [getattr(spawned.jail, f) for f in same]
    job = JobFacts(POLICIES[name].limits, JOB_UID)
    assert forked == compile_policy(POLICIES[name], V1, job, forked=True)  # pure
    assert forked_jail(POLICIES[name], V1, job) == forked.jail  # what the zygote is sent


@pytest.mark.parametrize("name", SHIPPED)
def test_the_zygotes_plan(name: str) -> None:
    policy = POLICIES[name]
    zygote = job_plans(policy)["zygote"]
    assert zygote.keep_caps and zygote.jail.rlimits is None and zygote.jail.uid == 0
    assert zygote.id_maps == (IdMap(0, JOB_UID + JOB_UIDS), IdMap(1073741824, 1073741824, JOB_UIDS))
    assert [m.options for m in zygote.jail.mounts if m.kind == "proc"] == [""]  # a full /proc
    assert zygote.program[6:] == policy.pool.preimport


@pytest.mark.parametrize("name", SHIPPED)
def test_the_tmpfs_options_are_spelled_once(name: str) -> None:
    """The config's /tmp and /dev/shm lines and what the zygote is sent are one spelling."""
    policy = POLICIES[name]
    cfg = nsjail_config(policy, V1)
    sent = forked_jail(policy, V1, JobFacts(policy.limits, JOB_UID))
    for mount in sent.mounts:
        assert render_mount(mount) in cfg.splitlines()


@pytest.mark.parametrize("name", SHIPPED)
def test_the_config_is_the_rendered_plan(name: str) -> None:
    policy = POLICIES[name]
    assert nsjail_config(policy, V1) == render_config(compile_policy(policy, V1))
    assert nsjail_config(policy, V1, zygote=True) == render_config(compile_zygote(policy, V1))
    cfg = render_config(compile_policy(policy, V1)).splitlines()
    assert [ln for ln in cfg if ln.startswith("mount {")] == [
        render_mount(m) for m in compile_policy(policy, V1).mounts
    ]


def test_a_jobs_plan_renders_the_same_config_as_its_policys() -> None:
    """The config is rendered once per policy; a job's own limits and uid go on nsjail's
    command line (where they override the config's)."""
    policy = POLICIES["default"]
    limits = effective_limits(policy, {"cpu_time_s": 3, "pids": 9})
    job = compile_policy(policy, V1, JobFacts(limits, JOB_UID))
    own = compile_policy(policy, V1)
    assert job.frame == own.frame and job.jail.mounts == own.jail.mounts
    assert own.id_maps == () and job.jail.rlimits is not None and job.jail.rlimits.cpu_s == 3


@pytest.mark.parametrize(("mode", "namespaces", "loopback"), [
    ("none", True, False), ("loopback", True, True), ("host", False, False),
])
def test_network_modes_in_the_plan(mode: str, namespaces: bool, loopback: bool) -> None:
    policy = load_policy_text(f"[network]\nmode = '{mode}'", "n.toml")
    for plan in job_plans(policy).values():
        assert ("net" in plan.jail.namespaces) == namespaces and plan.jail.loopback == loopback


def test_proc_none_and_no_shm_in_the_plan() -> None:
    policy = load_policy_text("[filesystem]\nproc = 'none'\nshm_mb = 0\n", "p.toml")
    plans = job_plans(policy)
    assert [m.target for m in plans["spawned"].jail.mounts] == ["/tmp"]
    assert [m.target for m in plans["zygote"].jail.mounts] == ["/tmp", "/proc"]
    assert plans["forked"].jail.detach == ("/tmp", "/proc")


def test_only_pooled_jails_warm_up() -> None:
    policy = POLICIES["default"]
    assert forked_jail(policy, V1, JobFacts(policy.limits, 1, pooled=True)).warm_up is True
    assert forked_jail(policy, V1, JobFacts(policy.limits, 1)).warm_up is False


def test_a_forked_plan_needs_a_job() -> None:
    with pytest.raises(ValueError, match="a job's"):
        compile_policy(POLICIES["default"], V1, forked=True)


def test_render_mount_kinds() -> None:
    assert render_mount(Mount("/bin", "symlink", source="usr/bin")) == (
        'mount { src: "usr/bin" dst: "/bin" is_symlink: true }'
    )
    assert render_mount(Mount("/x", "bind", source="/y", writable=True)) == (
        'mount { src: "/y" dst: "/x" is_bind: true rw: true }'
    )
    assert render_mount(Mount("/p", "proc", noexec=True)) == (
        'mount { dst: "/p" fstype: "proc" options: "" rw: false noexec: true }'
    )


def test_the_plan_is_frozen() -> None:
    plan = compile_policy(POLICIES["default"], V1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.name = "other"  # type: ignore[misc]
    assert isinstance(plan.jail, JailSetup)


def test_the_compiler_builds_the_jails_first_frame_beside_its_plan() -> None:
    """Harden, what a jail's runtime locks itself down by, comes from the same policy as the
    plan (jaild.policy.compile.harden): the seccomp spec given, the [files] limits, and a
    network refusal exactly when the policy has no network (control: loopback has none)."""
    from jaild.policy.compile import harden
    from jaild.protocol import PROTOCOL_VERSION

    spec = {"default": "kill_process", "allow": ["read"]}
    none = load_policy_text("[files]\nmax_files = 7\n", "none.toml")
    msg = harden(none, spec)
    assert (msg.protocol, msg.seccomp) == (PROTOCOL_VERSION, spec)
    assert msg.file_limits["max_files"] == 7
    assert msg.network is not None and "'none'" in msg.network.explanation
    loopback = load_policy_text("[network]\nmode = 'loopback'\n", "lo.toml")
    assert harden(loopback, spec).network is None
