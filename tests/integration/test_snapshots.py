"""Sessions that outlive their jail: snapshot, restore, fork, pause -- on the real daemon.

Every snapshot is taken in a real session's jail and restored in another, fresh one; the
daemon is restarted for real where the state must outlive it.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild import Client
from jaild.errors import (
    BadRequest,
    PermissionDenied,
    QuotaExceeded,
    SessionClosed,
    SnapshotFailed,
    UnknownSnapshot,
)
from tests.conftest import (
    REPO,
    DaemonHandle,
    ForeignClient,
    guard,
    policy_texts,
    start_daemon,
    sweep_cgroups,
)

pytestmark = pytest.mark.integration

POLICIES = {
    # no warm pool: a restart is quicker, and every jail here is made for its session
    "snap": '[pool]\nmax = 0\n',
    "snap-tiny": '[pool]\nmax = 0\n[session]\nsnapshot_max_mb = 1\n',
    "snap-off": '[pool]\nmax = 0\n[session]\nsnapshots = false\n',
}


def start(directory: Path, socket: str | None = None,
          policies: dict[str, str] | None = None) -> DaemonHandle:
    return start_daemon(directory, policies or POLICIES, with_repo_policies=False,
                        socket=socket)


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    handle = start(tmp_path_factory.mktemp("snapshots"))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[[], DaemonHandle]]:
    """``restart()``: (re)start a daemon on one socket; the last is stopped at the end. It
    serves the one policy its test uses: each policy served costs every start a zygote and a
    self-test."""
    handles: list[DaemonHandle] = []

    def restart() -> DaemonHandle:
        socket = None
        if handles:
            socket = handles[-1].socket
            assert handles[-1].stop() == 0, handles[-1].log()[-3000:]
            sweep_cgroups(handles[-1])
        handles.append(start(tmp_path / "d", socket, {"snap": POLICIES["snap"]}))
        return handles[-1]

    yield restart
    if handles:
        handles[-1].stop()
        sweep_cgroups(handles[-1])


def jail_uids(handle: DaemonHandle, ident: str) -> set[int]:
    """The host uids of the processes in a session's jail (its cgroup)."""
    uids = set()
    for pid in handle.job_pids(ident):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uids.add(int(next(line for line in status.splitlines()
                          if line.startswith("Uid:")).split()[1]))
    return uids


BUILD = """\
import random, json, collections, os, sys
random.seed({i})
json.jaild_mark = {i}           # state of an imported module
base = {i}
items = [base, str(base), {{"k": base}}]
counts = collections.Counter("ab" * {i})
def bump(n):                   # sees the session's globals, as before the snapshot
    return base + n
class Box:
    def __init__(self, v):
        self.v = v
    def twice(self):
        return 2 * self.v
box = Box({i})
adder = (lambda k: lambda x: x + k)({i})   # a closure
os.makedirs("data/sub", exist_ok=True)
with open("data/sub/note.txt", "w") as f:
    f.write("note {i}")
expected_draw = random.Random({i}).random()
"""

CHECK = """\
base += 1000                   # a later assignment: the restored bump() must see it
(base, items, dict(counts), bump(1), box.twice(), adder(1), json.jaild_mark,
 open("data/sub/note.txt").read(), random.random() == expected_draw)
"""


def test_state_survives_a_daemon_restart_50_times(
        restartable: Callable[[], DaemonHandle]) -> None:
    """Each round: restart the daemon, restore the last round's snapshot in a fresh jail and
    find its state (variables, functions, classes, a closure, an imported module's state,
    the random generator's position, a file below the working directory), then build the
    next state and snapshot it."""
    handle = restartable()
    previous: tuple[int, str, str] | None = None
    for i in range(50):
        with Client(handle.socket) as c:
            if previous is not None:
                n, snap_id, old_session = previous
                with c.restore(snap_id) as s:
                    assert s.id != old_session
                    r = s.run(CHECK)
                    assert r.status == "ok", (i, r.error)
                    assert r.result == [n + 1000, [n, str(n), {"k": n}],
                                        {"a": n, "b": n} if n else {}, n + 1001, 2 * n, n + 1,
                                        n, f"note {n}", True], i
                    # a fresh jail: its own cgroup; the old one is gone with its daemon
                    assert not handle.cgroup_dir(old_session).exists()
                    assert jail_uids(handle, s.id or "")
                c.delete_snapshot(snap_id)
            with c.session("snap") as s:
                r = s.run(BUILD.format(i=i))
                assert r.status == "ok", (i, r.error)
                snap = s.snapshot()
                previous = (i, snap["id"], s.id or "")
        handle = restartable()


def test_a_fork_of_8_sees_only_its_own_changes(sd: DaemonHandle) -> None:
    """Eight forks of one session, each in its own jail (its own uid and cgroup), each
    changing its copy in memory and on disk: none sees another's change, nor does the
    session forked (positive control: each sees its own)."""
    with Client(sd.socket) as c, c.session("snap") as origin:
        origin.run("shared = {'n': 0}\nlog = []\nopen('common.txt', 'w').write('origin')")
        forks = origin.fork(8)
        try:
            assert len({f.id for f in forks} | {origin.id}) == 9
            uids = [jail_uids(sd, f.id or "") for f in forks] + [jail_uids(sd, origin.id or "")]
            assert all(uids) and len(set().union(*uids)) == 9, uids
            for k, f in enumerate(forks):
                r = f.run(f"shared['n'] += {k + 1}\nlog.append({k})\n"
                          f"open('common.txt', 'w').write('fork {k}')\n"
                          f"open('mine-{k}.txt', 'w').write('{k}')")
                assert r.status == "ok", r.error
            for k, f in enumerate(forks):
                r = f.run("import os\n(shared['n'], log, open('common.txt').read(), "
                          "sorted(n for n in os.listdir('.') if n.startswith('mine')))")
                assert r.result == [k + 1, [k], f"fork {k}", [f"mine-{k}.txt"]], (k, r.result)
            r = origin.run("import os\n(shared['n'], log, open('common.txt').read(), "
                           "sorted(os.listdir('.')))")
            assert r.result == [0, [], "origin", ["common.txt"]]
            # the fork's own snapshot is gone again
            assert [e for e in c.snapshots() if e["session"] == origin.id] == []
        finally:
            for f in forks:
                f.close()


def test_numpy_and_pandas_state_survives(tmp_path: Path) -> None:
    """A data session (the data policy's environment): arrays, a frame and numpy's random
    generator come back in a fresh jail."""
    handle = start_daemon(tmp_path / "data", {"data": (REPO / "policies" / "data.toml")
                                              .read_text()}, with_repo_policies=False)
    try:
        with Client(handle.socket) as c:
            with c.session("data") as s:
                r = s.run("import numpy as np, pandas as pd\n"
                          "rng = np.random.default_rng(5)\n"
                          "a = np.arange(12).reshape(3, 4)\n"
                          "df = pd.DataFrame({'x': [1, 2, 3], 'y': ['a', 'b', 'c']})\n"
                          "expected = np.random.default_rng(5).random()")
                assert r.status == "ok", r.error
                snap = s.snapshot()
            with c.restore(snap["id"]) as s:
                r = s.run("(int(a.sum()), df['x'].sum(), list(df['y']), "
                          "rng.random() == expected, np.__version__ == np.version.version)")
                assert r.status == "ok" and r.result == [66, 6, ["a", "b", "c"], True, True], \
                    r.error
    finally:
        handle.stop()
        sweep_cgroups(handle)


def test_pause_releases_the_jail_and_the_next_run_restores_it(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session("snap") as s:
        r = s.run("import os\nblob = bytearray(16 << 20)\nblob[-1] = 7\ntotal = 41\n"
                  "open('kept.txt', 'w').write('kept')\nos.getpid()")
        assert r.status == "ok"
        cgroup = sd.cgroup_dir(s.id or "")
        assert cgroup.exists() and sd.job_pids(s.id or "")
        row = next(j for j in c.jobs() if j["id"] == s.id)
        assert row["state"] == "idle" and row["memory_bytes"] > 16 << 20
        kept = s.pause()
        assert s.paused and kept > 16 << 20  # the bytearray is in the snapshot
        # the jail is gone: no process, no cgroup, so none of its memory is held
        deadline = time.monotonic() + guard(10)
        while cgroup.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not cgroup.exists()
        row = next(j for j in c.jobs() if j["id"] == s.id)
        assert row["state"] == "paused" and row.get("memory_bytes") is None
        assert [e["kind"] for e in c.snapshots() if e["session"] == s.id] == ["pause"]
        r = s.run("total += 1\n(total, len(blob), blob[-1], open('kept.txt').read())")
        assert r.status == "ok" and r.result == [42, 16 << 20, 7, "kept"]
        assert not s.paused  # and its state is deleted once resumed
        assert [e for e in c.snapshots() if e["session"] == s.id] == []
        assert next(j for j in c.jobs() if j["id"] == s.id)["state"] == "idle"
        assert r.session is not None and r.session["run"] == 2


def test_an_idle_session_pauses_by_itself(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session("snap", pause_after_s=0.3) as s:
        s.run("x = 'still here'")
        deadline = time.monotonic() + guard(10)
        while not s.paused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.paused
        assert next(j for j in c.jobs() if j["id"] == s.id)["state"] == "paused"
        assert s.run("x").result == "still here"


def test_what_cannot_be_captured_fails_naming_it(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session("snap") as s:
        r = s.run("import threading, io\nf = open('scratch.txt', 'w')\ng = (i for i in [1])\n"
                  "lock = threading.Lock()\nok = 1\nfr = open('scratch.txt')\n"
                  "mem = io.StringIO('kept')")
        assert r.status == "ok", r.error
        with pytest.raises(SnapshotFailed) as caught:
            s.snapshot()
        message = str(caught.value)
        # a file open for reading too (cloudpickle would make it a StringIO of its rest)
        for name in ("'f'", "'g'", "'lock'", "'fr'"):
            assert name in message, message
        assert "'ok'" not in message and "'mem'" not in message  # an in-memory file is a value
        s.run("del f, g, lock, fr")
        s.run("import os\nos.symlink('/etc/passwd', 'link')")
        with pytest.raises(SnapshotFailed, match="link"):
            s.snapshot()
        r = s.run("os.unlink('link')\nos.link('scratch.txt', 'twin')")
        assert r.status == "ok", r.error
        with pytest.raises(SnapshotFailed, match=r"twin|scratch"):  # a hard link
            s.snapshot()
        s.run("os.unlink('twin')")
        assert s.snapshot()["bytes"] > 0  # positive control: now it can be taken
        assert s.run("ok").result == 1  # and the session goes on
    with Client(sd.socket) as c, c.session("snap-tiny") as s:
        s.run("big = b'x' * (2 << 20)")
        with pytest.raises(SnapshotFailed, match="snapshot_max_mb"):
            s.snapshot()
        s.run("del big\nopen('huge.bin', 'wb').write(b'y' * (2 << 20))")
        with pytest.raises(SnapshotFailed, match=r"huge\.bin"):
            s.snapshot()
        assert s.run("1 + 1").result == 2


def test_a_policy_without_snapshots_refuses_them(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session("snap-off") as s:
        with pytest.raises(PermissionDenied, match="snapshots"):
            s.snapshot()
        with pytest.raises(PermissionDenied, match="snapshots"):
            s.pause()
        assert s.run("2").result == 2
    with Client(sd.socket) as c, c.session("snap") as s:
        snap = s.snapshot()
    with Client(sd.socket) as c:
        with pytest.raises(BadRequest, match="policy 'snap'"):
            c.restore(snap["id"], policy="snap-tiny").open()
        with pytest.raises(PermissionDenied, match="snapshots"):
            c.restore(snap["id"], policy="snap-off").open()


def test_a_crafted_snapshot_runs_only_in_the_restoring_jail(sd: DaemonHandle) -> None:
    """The jail's code makes its snapshot a pickle that runs code when unpickled: it runs in
    the new jail (the positive control: it did run there) and touches nothing on the host;
    the daemon never unpickled it. A snapshot of bytes that are no snapshot at all fails to
    restore with a clear error."""
    marker = f"/tmp/jaild-snapshot-pwned-{secrets.token_hex(6)}"
    with Client(sd.socket) as c:
        with c.session("snap") as s:
            s.run("import os\n"
                  "class Evil:\n"
                  "    def __reduce__(self):\n"
                  f"        return (os.system, ('touch {marker}; id -u > {marker}',))\n"
                  "evil = Evil()")
            snap = s.snapshot()
        assert not os.path.exists(marker)
        with c.restore(snap["id"]) as s:
            r = s.run(f"open({marker!r}).read().strip()")
            assert r.status == "ok" and r.result != "0"  # ran in the jail, not as root
        assert not os.path.exists(marker)  # nothing on the host
        with c.session("snap") as s:  # a runtime replaced by the job's code: any bytes
            r = s.run("import jaild.runtime.snapshot as m\n"
                      "m.take = lambda *a: b'\\xc1not a snapshot'")
            assert r.status == "ok", r.error
            junk = s.snapshot()
        with pytest.raises(SnapshotFailed, match="not a jaild snapshot"):
            c.restore(junk["id"]).open()
        assert c.run("6 * 7", "snap").result == 42  # the daemon serves on


def test_a_crafted_snapshot_too_large_is_never_stored(sd: DaemonHandle) -> None:
    """The job's code replaces the runtime's snapshot with more bytes than the policy allows
    (``snap-tiny``: 1 MiB, its jail link's frame limit sized for it): the frame is refused,
    that session ends, nothing is stored, and the daemon serves on."""
    with Client(sd.socket) as c:
        with c.session("snap-tiny") as s:
            r = s.run("import jaild.runtime.snapshot as m\n"
                      "m.take = lambda *a: b'x' * (8 << 20)")
            assert r.status == "ok", r.error
            with pytest.raises(SnapshotFailed, match="not taken"):
                s.snapshot()
            deadline = time.monotonic() + guard(10)  # its SessionClosed follows the Error
            while s.closed is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert s.closed == "error"  # the jail broke its link: killed (a ChannelError)
            assert "the jail sent a result of 8388608 bytes" in s.close_message
        assert [e for e in c.snapshots() if e["session"] == s.id] == []
        assert c.run("6 * 7", "snap").result == 42


def test_snapshots_are_the_principals_own(sd: DaemonHandle,
                                          world_daemon: Callable[[], DaemonHandle],
                                          foreign_client: ForeignClient) -> None:
    d = world_daemon()
    with Client(d.socket) as root, root.session() as s:
        s.run("secret = 'root only'")
        snap = s.snapshot()
    code = (
        "import sys, json\nfrom jaild.client import Client\n"
        "from jaild.errors import UnknownSnapshot\nc = Client(sys.argv[1])\nout = []\n"
        "out.append(c.snapshots())\n"
        "for act in ('restore', 'delete'):\n"
        "    try:\n"
        "        if act == 'restore':\n"
        "            c.restore(sys.argv[2], policy='default').open()\n"
        "        else:\n"
        "            c.delete_snapshot(sys.argv[2])\n"
        "        out.append('done')\n"
        "    except UnknownSnapshot as e:\n"
        "        out.append('unknown')\n"
        "with c.session() as s:\n"
        "    s.run('mine = 1')\n"
        "    out.append(s.snapshot()['id'] != sys.argv[2])\n"
        "out.append(len(c.snapshots()))\n"
        "print(json.dumps(out))\n"
    )
    out = foreign_client.run(code, d.socket, snap["id"], uid=65534, gid=65534)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], "unknown", "unknown", True, 1]
    with Client(d.socket) as root:  # positive control: its owner restores it
        assert [e["id"] for e in root.snapshots()] == [snap["id"]]
        with root.restore(snap["id"]) as s:
            assert s.run("secret").result == "root only"
    store = Path(d.config.snapshot_dir)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    for f in store.rglob("*"):
        assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600), f


def test_the_cli_lists_and_deletes_snapshots(sd: DaemonHandle) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "jaild", *args, "--socket", sd.socket],
                              capture_output=True, text=True, timeout=guard(60), check=False)

    with Client(sd.socket) as c, c.session("snap") as s:
        snap = s.snapshot()
        listed = cli("snapshots")
        assert listed.returncode == 0 and snap["id"] in listed.stdout and s.id in listed.stdout
        s.pause()
        assert "paused" in cli("ps").stdout
        mine = [e for e in json.loads(cli("snapshots", "--json").stdout) if e["session"] == s.id]
        assert sorted(e["kind"] for e in mine) == ["pause", "snapshot"]
        assert cli("snapshots", "--rm", snap["id"]).returncode == 0
        assert cli("snapshots", "--rm", snap["id"]).returncode == 1  # gone
        assert snap["id"] not in cli("snapshots").stdout
        assert s.run("1").result == 1


def test_quota_and_unknown_ids(tmp_path: Path) -> None:
    from tests.integration.test_faults import write_config

    config = write_config(tmp_path, "[limits]\nsnapshot_max_count = 2\n")
    handle = start_daemon(tmp_path / "q", POLICIES, with_repo_policies=False,
                          args=("--config", config))
    try:
        with Client(handle.socket) as c, c.session("snap") as s:
            first, _ = s.snapshot(), s.snapshot()
            with pytest.raises(QuotaExceeded, match="snapshot_max_count"):
                s.snapshot()
            c.delete_snapshot(first["id"])
            s.snapshot()  # room again
            with pytest.raises(UnknownSnapshot):
                c.delete_snapshot("snap-" + "0" * 32)
            with pytest.raises(UnknownSnapshot):
                c.restore("snap-" + "0" * 32, policy="snap").open()
            with pytest.raises(SessionClosed):
                s.close()
                s.snapshot()
    finally:
        handle.stop()
        sweep_cgroups(handle)


@pytest.fixture
def world_daemon(world_dir: Path, tmp_path: Path) -> Iterator[Callable[[], DaemonHandle]]:
    """A daemon whose socket uid 65534 (group nogroup) may reach."""
    from tests.integration.test_faults import write_config

    started: list[DaemonHandle] = []

    def make() -> DaemonHandle:
        os.chmod(world_dir, 0o755)
        config = write_config(tmp_path, '[daemon]\nsocket_group = "nogroup"\n')
        handle = start_daemon(world_dir / "d", policy_texts("default"), with_repo_policies=False,
                              args=("--config", config))
        os.chmod(world_dir / "d", 0o755)
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()
        sweep_cgroups(handle)
