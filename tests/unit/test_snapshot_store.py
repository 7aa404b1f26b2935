"""The daemon's snapshot store (jaild.daemon.state.snapshots) on a real directory, and the in-jail
snapshot module run by the jail environment's interpreter (which has cloudpickle)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from jaild.daemon.state.snapshots import SnapshotStore
from jaild.errors import LocalProtocolError, QuotaExceeded, UnknownSnapshot
from jaild.protocol.records import SnapshotEntry, SnapshotKind
from tests.conftest import REPO, STATE_DIR


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def store(tmp_path: Path, clock: Clock | None = None, quota: int = 1 << 20,
          count: int = 4) -> SnapshotStore:
    return SnapshotStore(str(tmp_path / "snaps"), quota, count, clock or Clock())


def save(s: SnapshotStore, owner: int | str, blob: bytes = b"state", ttl: float = 60,
         kind: str = "snapshot") -> str:
    return s.save(owner, blob, policy="p", session="ses-1", ttl_s=ttl, kind=kind).id


def test_each_principal_sees_only_its_own(tmp_path: Path) -> None:
    s = store(tmp_path)
    mine = save(s, 1000, b"mine")
    theirs = save(s, "cert-abc", b"theirs")
    assert [e.id for e in s.entries(1000)] == [mine]
    assert s.load(1000, mine)[1] == b"mine"
    for owner, other in ((1000, theirs), ("cert-abc", mine), ("1000", mine)):
        with pytest.raises(UnknownSnapshot, match="of yours"):
            s.load(owner, other)
        with pytest.raises(UnknownSnapshot):
            s.delete(owner, other)
    assert s.load("cert-abc", theirs)[1] == b"theirs"  # positive control


def test_files_are_the_daemons_alone(tmp_path: Path) -> None:
    s = store(tmp_path)
    save(s, 1000)
    root = Path(s.root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for f in root.rglob("*"):
        assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600)
        assert not f.is_symlink()


def test_quota_of_bytes_and_of_count(tmp_path: Path) -> None:
    s = store(tmp_path, quota=100, count=2)
    first = save(s, 1, b"x" * 60)
    with pytest.raises(QuotaExceeded, match="snapshot_quota_mb"):
        save(s, 1, b"x" * 41)
    save(s, 2, b"x" * 41)  # another principal's quota is its own
    save(s, 1, b"x" * 40)
    with pytest.raises(QuotaExceeded, match="snapshot_max_count"):
        save(s, 1, b"")
    s.delete(1, first)
    save(s, 1, b"x" * 60)
    assert s.usage(1).bytes == 100


def test_the_whole_store_has_a_quota_beside_each_principals(tmp_path: Path) -> None:
    """Many principals, each within its own quota, cannot fill the disk between them: past
    the store's total the save is refused, naming the setting and not the others' usage;
    an expired snapshot no longer counts; each principal's own quota still applies (the
    control: below the total, a new principal saves)."""
    clock = Clock()
    s = SnapshotStore(str(tmp_path / "snaps"), 100, 4, clock, total_bytes=250)
    for owner in ("cert-a", "cert-b"):
        save(s, owner, b"x" * 100, ttl=10)
    save(s, "cert-c", b"x" * 50)  # 250: exactly the total
    with pytest.raises(QuotaExceeded, match="snapshot_total_quota_mb") as full:
        save(s, "cert-d", b"x")
    assert "cert-a" not in full.value.message and "200" not in full.value.message
    clock.now += 11  # a's and b's expire
    save(s, "cert-d", b"x" * 100)
    assert s.total() == 150


def test_a_snapshot_expires_at_its_ttl(tmp_path: Path) -> None:
    clock = Clock()
    s = store(tmp_path, clock)
    short = save(s, 1, ttl=10)
    long = save(s, 1, ttl=100)
    clock.now += 11
    with pytest.raises(UnknownSnapshot):
        s.load(1, short)
    assert [e.id for e in s.entries(1)] == [long]
    assert s.sweep() == 1
    assert sorted(p.name for p in Path(s.root).rglob("*.snap")) == [f"{long}.snap"]


def test_the_sweep_at_start_drops_pauses_and_strays(tmp_path: Path) -> None:
    s = store(tmp_path)
    kept = save(s, 1)
    save(s, 1, kind="pause")
    directory = next(Path(s.root).iterdir())
    (directory / ".half-written.tmp").write_bytes(b"")
    (directory / ("snap-" + "a" * 32 + ".snap")).write_bytes(b"no entry")
    assert s.sweep(pauses_too=True) == 1
    assert sorted(p.name for p in directory.iterdir()) == [f"{kept}.json", f"{kept}.snap"]


def test_the_sweep_at_start_keeps_only_the_parked_runs_states_it_is_told_of(
        tmp_path: Path) -> None:
    s = store(tmp_path)
    waiting = save(s, 1, kind="parked")
    save(s, 1, kind="parked")  # its run is gone (dropped, or lost in a crash)
    assert s.sweep(pauses_too=True, keep={waiting}) == 1
    assert [e.id for e in s.entries(1)] == [waiting]
    assert s.sweep() == 0  # a sweep on a save keeps every state that has not expired


def test_damaged_bytes_are_never_handed_out(tmp_path: Path) -> None:
    s = store(tmp_path)
    sid = save(s, 1, b"original")
    path = next(Path(s.root).rglob(f"{sid}.snap"))
    path.write_bytes(b"tampered")
    with pytest.raises(UnknownSnapshot, match="damaged"):
        s.load(1, sid)
    with pytest.raises(UnknownSnapshot):
        s.load(1, sid)  # and it is gone


def test_an_entry_naming_another_owner_is_not_theirs(tmp_path: Path) -> None:
    """The entry's owner is checked, not only the directory it lies in."""
    s = store(tmp_path)
    sid = save(s, 1)
    meta = next(Path(s.root).rglob(f"{sid}.json"))
    data = json.loads(meta.read_text())
    data["owner"] = 2
    meta.write_text(json.dumps(data))
    with pytest.raises(UnknownSnapshot):
        s.load(1, sid)


def test_malformed_ids_are_unknown(tmp_path: Path) -> None:
    s = store(tmp_path)
    for bad in ("snap-../../etc", "../x", "snap-" + "g" * 32, ""):
        with pytest.raises(UnknownSnapshot):
            s.entry(1, bad)


JAIL_PYTHON = os.path.join(STATE_DIR, "envs", "default", "bin", "python3")

ROUND_TRIP = r"""
import io, os, sys, tempfile, random, json
from jaild.runtime import files, snapshot
from jaild.errors import SnapshotError
limits = files.FileLimits(max_files=16, max_bytes=1 << 20, max_depth=4, max_name_chars=64,
                          max_path_chars=256)
src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
ns = {"__name__": "__main__", "__builtins__": __builtins__, "tools": object()}
exec("import random, json, sys\nrandom.seed(3)\nx = [1]\ndef f(): return x\n"
     "with open('%s/a.txt', 'w') as fh:\n    fh.write('A')\n" % src, ns)
blob = snapshot.take(ns, src, limits, 1 << 20)
x_before = random.Random(3).random()
random.seed(99)  # this process's generator moves on; the snapshot's does not
fresh = {"__name__": "__main__", "__builtins__": __builtins__, "tools": "new tools"}
out = snapshot.restore(blob, fresh, dst, limits)
out["x"].append(2)
assert out["f"]() == [1, 2]               # the function's globals are the namespace
assert out["tools"] == "new tools"        # the runtime's names are the new jail's
assert out["random"].random() == x_before  # the generator's state came back
assert out["fh"].closed and "a.txt" in out["fh"].name
assert open(os.path.join(dst, "a.txt")).read() == "A"
for bad in (b"", b"\xc1", b"\x80"):
    try:
        snapshot.restore(bad, fresh, dst, limits)
        raise AssertionError("restored junk")
    except SnapshotError as e:
        assert "not a jaild snapshot" in str(e)
print("ok")
"""


def test_the_runtime_round_trips_a_session(tmp_path: Path) -> None:
    assert os.path.exists(JAIL_PYTHON), "build the jail environment first: make jail-env"
    out = subprocess.run([JAIL_PYTHON, "-I", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})"
                          f"\n{ROUND_TRIP}"], capture_output=True, text=True, timeout=60,
                         check=False, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_kind_is_typed_in_the_daemon_and_a_word_in_its_file(tmp_path: Path) -> None:
    s = store(tmp_path)
    sid = save(s, 1, kind=SnapshotKind.PAUSE)
    meta = next(Path(s.root).rglob(f"{sid}.json"))
    assert json.loads(meta.read_text())["entry"]["kind"] == "pause"  # the file's word
    (entry,) = s.entries(1)
    assert entry.kind is SnapshotKind.PAUSE  # read back: the member
    assert save(s, 1, kind="parked") and {e.kind for e in s.entries(1)} == {
        SnapshotKind.PAUSE, SnapshotKind.PARKED}
    with pytest.raises(ValueError, match="'nap'"):
        save(s, 1, kind="nap")


def test_an_entry_of_an_unknown_kind_read_back_is_refused_naming_it(tmp_path: Path) -> None:
    s = store(tmp_path)
    sid = save(s, 1)
    meta = next(Path(s.root).rglob(f"{sid}.json"))
    data = json.loads(meta.read_text())
    with pytest.raises(LocalProtocolError,
                       match=r"field 'kind': expected one of \['parked', 'pause', 'snapshot'\], got 'nap'"):
        SnapshotEntry.from_wire({**data["entry"], "kind": "nap"})
    data["entry"]["kind"] = "nap"
    meta.write_text(json.dumps(data))
    with pytest.raises(LocalProtocolError, match="got 'nap'"):  # the store's error, as before
        s.load(1, sid)
