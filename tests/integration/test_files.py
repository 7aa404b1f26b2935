"""Files in and out of jails through the real daemon -- and the link attacks that must fail.

The daemon never opens anything in a jail's filesystem: the in-jail runtime writes the
uploads and reads what comes back, and the daemon checks that listing as hostile input.
Each attack below is planted by jailed code; the positive control shows the planted thing
really works (inside the jail the link resolves, the FIFO blocks a reader, ...), so the
refusal is the defence at work and not an accident.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import BadRequest
from jaild.protocol.messages import Error, JobDescription, Message, RunJob
from tests.conftest import DaemonHandle, RawClient, guard

pytestmark = pytest.mark.integration

BINARY = bytes(range(256)) * 64


def reasons(r: object) -> dict[str, str]:
    return {s["path"]: s["reason"] for s in r.files_skipped}  # type: ignore[attr-defined]


def test_uploads_are_there_and_changes_come_back(client: Client, tmp_path: Path) -> None:
    local = tmp_path / "notes.txt"
    local.write_text("from a local file\n")
    r = client.run(
        "import os, hashlib\n"
        "seen = sorted(os.path.join(d, f)[2:] for d, _, fs in os.walk('.') for f in fs)\n"
        "os.makedirs('out/deep', exist_ok=True)\n"
        "open('out/deep/result.bin', 'wb').write(open('in/blob.bin', 'rb').read()[::-1])\n"
        "open('notes.txt', 'a').write('and a line from the jail\\n')\n"
        "(seen, hashlib.sha256(open('in/blob.bin', 'rb').read()).hexdigest())",
        files={"in/blob.bin": BINARY, "notes.txt": str(local), "untouched.txt": b"same"},
        download=True,
    )
    assert r.status == "ok", r.error
    seen, digest = r.result
    assert seen == ["in/blob.bin", "notes.txt", "untouched.txt"]
    assert digest == hashlib.sha256(BINARY).hexdigest()  # binary-safe both ways
    listed = {f["path"]: f for f in r.files}
    assert set(listed) == {"out/deep/result.bin", "notes.txt"}  # created or changed only
    assert listed["out/deep/result.bin"]["size"] == len(BINARY)
    assert listed["out/deep/result.bin"]["sha256"] == hashlib.sha256(BINARY[::-1]).hexdigest()
    assert r.downloads == {
        "out/deep/result.bin": BINARY[::-1],
        "notes.txt": b"from a local file\nand a line from the jail\n",
    }
    written = r.save_files(str(tmp_path / "dl"))
    assert sorted(written) == sorted(str(tmp_path / "dl" / p) for p in listed)
    assert (tmp_path / "dl/out/deep/result.bin").read_bytes() == BINARY[::-1]


def test_download_patterns_pick_any_file(client: Client) -> None:
    r = client.run(
        "open('a.csv', 'w').write('1')\nopen('b.txt', 'w').write('2')",
        files={"old.csv": b"0"},
        download=["*.csv"],
    )
    assert r.downloads == {"a.csv": b"1", "old.csv": b"0"}
    assert {f["path"] for f in r.files} == {"a.csv", "b.txt"}


def raw_run(socket_path: str, msg: RunJob) -> Message | None:
    """Send one RunJob past the client library's own checks; the daemon's first answer."""
    with RawClient(socket_path) as raw:
        raw.send(msg)
        return raw.next()


def test_upload_limits_are_enforced_with_clear_errors(sd_files: DaemonHandle) -> None:
    with Client(sd_files.socket) as c:
        cases = [
            ({f"f{i}": b"" for i in range(5)}, "more than 4 files"),
            ({"big": b"x" * 2000}, "more than 1024 bytes"),
            ({"a/b/c/d": b""}, "deeper than 3"),
            ({"n" * 40: b""}, "longer than 32"),
            ({"../escape": b""}, ".."),
            ({"/etc/passwd": b""}, "absolute"),
            ({"a/./b": b""}, "'.'"),
            ({"bad\nname": b""}, "control character"),
            ({"x": b"", "x/y": b""}, "also a file"),
        ]
        for files, reason in cases:
            # the daemon checks (the client library refuses the worst before sending)
            req = RunJob(ref=1, job=JobDescription(code="1", files=files), policy="smallfiles")
            answer = raw_run(sd_files.socket, req)
            assert isinstance(answer, Error) and answer.code == "bad_request", answer
            assert "refused by policy 'smallfiles'" in answer.message
            assert reason in answer.message, (files, answer.message)
        with pytest.raises(BadRequest, match="more than 4 files"):
            c.run("1", policy="smallfiles", files={f"f{i}": b"" for i in range(5)})
        assert c.run("1 + 1", policy="smallfiles").result == 2  # and the daemon keeps serving


def test_collection_limits_skip_with_reasons(sd_files: DaemonHandle) -> None:
    with Client(sd_files.socket) as c:
        r = c.run(
            "import os\nfor i in range(6):\n    open(f'f{i}', 'w').write('x')\n"
            "open('big', 'wb').write(b'y' * 5000)\n"
            "os.makedirs('a/b/c/d')\nopen('a/b/c/d/e', 'w').write('deep')",
            policy="smallfiles", download=True,
        )
        assert r.status == "ok", r.error
        why = reasons(r)
        assert len(r.files) <= 4
        assert any("too many files" in v for v in why.values()), why
        assert "too large" in why.get("big", "") or "too many files" in why.get("big", ""), why
        assert any("too deep" in v for v in why.values()), why
        assert sum(len(v) for v in r.downloads.values()) <= 1024


@pytest.fixture(scope="module")
def sd_files(tmp_path_factory: pytest.TempPathFactory) -> DaemonHandle:
    from tests.conftest import policy_texts, start_daemon, sweep_cgroups

    handle = start_daemon(
        tmp_path_factory.mktemp("files"),
        {**policy_texts("default"),
         "smallfiles": "[files]\nmax_files = 4\nmax_bytes = 1024\nmax_depth = 3\n"
                       "max_name_chars = 32\nmax_path_chars = 64\n"},
        with_repo_policies=False,
    )
    yield handle  # type: ignore[misc]
    assert handle.stop() == 0
    sweep_cgroups(handle)


# --------------------------------------------------------------------------- attacks


def test_symlinks_the_jail_plants_are_never_followed(client: Client) -> None:
    r = client.run(
        "import os\n"
        "os.symlink('/usr/lib/os-release', 'leak')\n"
        "os.symlink('/usr/lib', 'libdir')\n"
        "os.symlink('/proc/self/environ', 'env')\n"
        "open('leak').read()[:4]",  # positive control: inside, the link resolves
        download=["*"],
    )
    assert r.status == "ok" and r.result, r.error
    why = reasons(r)
    assert why == {"leak": "symlink", "libdir": "symlink", "env": "symlink"}
    assert r.downloads == {} and r.files == []


def test_fifos_and_devices_cannot_even_be_planted(client: Client) -> None:
    """mknod/mknodat are outside every seccomp profile (and can never be allowed), so a jail
    cannot make a FIFO or a device for the collector to trip on; the collector skips them
    anyway (tests/unit/test_files.py plants both on the host and checks a FIFO never blocks)."""
    for code in ("import os\nos.mkfifo('pipe')", "import os, stat\nos.mknod('dev', stat.S_IFCHR, 0)"):
        r = client.run(code)
        assert r.status == "policy_violation" and "mknod" in r.error["message"], r.error
    # positive control: the same call works unjailed
    from tests.conftest import run_unjailed

    out = run_unjailed("import os, tempfile, stat\nd = tempfile.mkdtemp()\n"
                       "os.mkfifo(d + '/p')\nprint(stat.S_ISFIFO(os.stat(d + '/p').st_mode))")
    assert out.stdout.strip() == "True", out.stderr


def test_hard_links_are_skipped_and_host_files_cannot_be_linked(client: Client) -> None:
    r = client.run(
        "import os, errno\nopen('a', 'w').write('secret')\nos.link('a', 'b')\n"
        "try:\n    os.link('/usr/bin/python3', 'host')\n    outcome = 'linked'\n"
        "except OSError as e:\n    outcome = errno.errorcode[e.errno]\noutcome",
        download=["*"],
    )
    assert r.status == "ok", r.error
    assert r.result == "EXDEV"  # the jail's /tmp is its own filesystem: no link to the host
    assert reasons(r) == {"a": "hard link", "b": "hard link"}
    assert r.downloads == {}


def test_sparse_and_huge_files_are_refused_not_read(client: Client) -> None:
    r = client.run(
        "f = open('sparse', 'wb')\nf.truncate(15 << 20)\nf.close()\n"
        "import os\nos.stat('sparse').st_size",
        download=["*"], timeout=10,
    )
    assert r.status == "ok" and r.result == 15 << 20, r.error
    assert reasons(r) == {"sparse": "sparse file"}
    # refused before it was read: a file read is listed with its hash, and sent if asked for
    assert [f["path"] for f in r.files] == [] and r.downloads == {}


def test_a_forged_listing_is_checked_by_the_daemon(client: Client) -> None:
    """The user's code runs in the runtime's process and can replace the collector: what
    comes back is hostile input, checked entry by entry."""
    forge = (
        "open('trigger', 'w').write('t')  # the runtime lists only a working dir with files\n"
        "import jaild.runtime.files as f\n"
        "class Forged:\n"
        "    def to_wire(self):\n"
        "        good = b'fine'\n"
        "        import hashlib\n"
        "        h = lambda b: hashlib.sha256(b).hexdigest()\n"
        "        return {'files': [\n"
        "            {'path': '../../etc/passwd', 'size': 4, 'sha256': h(good)},\n"
        "            {'path': '/abs', 'size': 4, 'sha256': h(good)},\n"
        "            {'path': 'lie', 'size': 999, 'sha256': h(good)},\n"
        "            {'path': 'ok.txt', 'size': 4, 'sha256': h(good)}],\n"
        "          'data': {'../../etc/passwd': good, 'lie': good, 'ok.txt': good,\n"
        "                   'x/../../y': good},\n"
        "          'skipped': [{'path': 'z', 'reason': 'x' * 100000}]}\n"
        "f.collect = lambda *a, **k: Forged()\n"
    )
    r = client.run(forge, download=["*"])
    assert r.status == "ok", r.error
    assert r.files == [{"path": "ok.txt", "size": 4,
                        "sha256": hashlib.sha256(b"fine").hexdigest()}]
    assert r.downloads == {"ok.txt": b"fine"}
    why = reasons(r)
    assert all(v.startswith("refused by the daemon") for k, v in why.items() if k != "z"), why
    assert any("../../etc/passwd" in k for k in why) and any("lie" in k for k in why)
    assert len(why["z"]) < 1000  # the jail's own reasons are clipped


def test_uploads_replace_links_planted_in_a_session(client: Client) -> None:
    with client.session() as s:
        r = s.run("import os\nos.mkdir('real')\nopen('real/target', 'w').write('original')\n"
                  "os.symlink('real/target', 'data.csv')\nos.symlink('real', 'sub')")
        assert r.status == "ok", r.error
        r = s.run("import os\n(os.path.islink('data.csv'), open('data.csv').read(),"
                  " open('real/target').read(), os.path.islink('sub'))",
                  files={"data.csv": b"uploaded", "sub/new.txt": b"n"})
        assert r.status == "ok", r.error
        # the links were replaced, not written through
        assert r.result == [False, "uploaded", "original", False]


def test_cli_upload_and_download_dir(daemon: DaemonHandle, tmp_path: Path) -> None:
    src = tmp_path / "input.txt"
    src.write_text("hello")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "jaild", "run", "--socket", daemon.socket,
         "--upload", str(src), "--upload", f"{src}=data/copy.txt", "--download-dir", str(out),
         "-c", "open('upper.txt', 'w').write(open('data/copy.txt').read().upper())\n"
               "import os\nsorted(os.listdir('.'))"],
        capture_output=True, text=True, timeout=guard(60), check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "['data', 'input.txt', 'upper.txt']" in proc.stdout
    assert (out / "upper.txt").read_text() == "HELLO"
    assert sorted(os.listdir(out)) == ["upper.txt"]  # only what the run created or changed


# --------------------------------------------------------------------------- the collector,
# on the host, as root (like the daemon): the attacks a jail cannot even plant


@pytest.fixture
def host_tree(tmp_path: Path) -> Path:
    from tests.conftest import require_jail_host

    require_jail_host()  # fails, saying why, when not root: never skips
    (tmp_path / "tree").mkdir()
    return tmp_path / "tree"


def test_collector_does_not_follow_a_symlink_to_etc_shadow(host_tree: Path) -> None:
    from tests.unit.test_files import assert_no_leak, run

    os.symlink("/etc/shadow", host_tree / "shadow.txt")
    shadow = Path("/etc/shadow").read_bytes()
    assert shadow and (host_tree / "shadow.txt").read_bytes() == shadow  # control: it reaches
    c = run(host_tree)
    assert {s["path"]: s["reason"] for s in c.skipped} == {"shadow.txt": "symlink"}
    assert c.files == [] and c.data == {}
    assert_no_leak(c, shadow)


def test_collector_refuses_a_device_node(host_tree: Path) -> None:
    import stat

    from tests.unit.test_files import run

    os.mknod(host_tree / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero: endless
    fd = os.open(host_tree / "zero", os.O_RDONLY)
    try:
        assert os.read(fd, 16) == b"\0" * 16  # control: a working device
    finally:
        os.close(fd)
    c = run(host_tree)
    assert {s["path"]: s["reason"] for s in c.skipped} == {"zero": "device"}
    assert c.data == {}
