"""Side channels between tenants that the seccomp profiles close (docs/security.md, "Side channels").

Every jail binds the same host ``/usr`` read-only, and the kernel lets a reader of a file or
directory watch it (inotify, dnotify), lock it (``flock``) or ask who has it locked
(``F_GETLK``). So a jail could see a sibling's and the host's imports as they happened, two
jails could signal each other through a lock, and a jail could block a host process's
``flock`` on a ``/usr`` file. ``sysinfo()`` showed the host's task count, memory, load and
uptime; ``POSIX_FADV_DONTNEED`` dropped the shared files' pages from the host's page cache;
a ``memfd`` ran a binary despite the ``noexec`` ``/tmp``.

Each probe runs in the shipped policies (``default``, ``strict``, and ``data``, which the test
policy of that name stands for here: the same ``default`` profile), where it must be refused --
failed, not killed, so libraries fall back -- and, as the positive control, on the host and in
the test policy ``open-side-channels``, which re-opens the groups (``seccomp.allow``): there it
works, against a host process, so its failure in the shipped policies is the filter's doing.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonHandle, guard, run_unjailed

pytestmark = pytest.mark.integration

SHIPPED = ["default", "strict", "data"]
OPEN = "open-side-channels"
SHARED_FILE = "/usr/bin/env"  # in every jail's /usr bind, and on the host
LOCK_OFFSET = 4093  # a byte of SHARED_FILE the host read-locks for the lock-query probe


def _quiet_file() -> str:
    """A file in a /usr directory nothing else on the host is likely to read meanwhile, so a
    watch on it sees this test's access, not a storm of others' (``/usr/bin`` is busy)."""
    for directory in ("/usr/share/common-licenses", "/usr/share/licenses", "/usr/share/doc"):
        if os.path.isdir(directory):
            for entry in sorted(os.scandir(directory), key=lambda e: e.name):
                if entry.is_file(follow_symlinks=False):
                    return entry.path
    return SHARED_FILE


WATCHED_FILE = _quiet_file()
WATCHED_DIR = os.path.dirname(WATCHED_FILE)


def host_reads_shared_file() -> str:
    """A tool handler: a host process (this test's) opens and reads a file the jails share."""
    Path(WATCHED_FILE).read_bytes()
    return "read"


def host_tries_flock() -> str:
    """A tool handler: can a host process take an exclusive flock on the shared file?"""
    fd = os.open(SHARED_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "blocked"
    finally:
        os.close(fd)  # releases the lock if it was taken
    return "free"


HOST_TOOLS = {"touch": host_reads_shared_file, "host_flock": host_tries_flock}


# ---- sysinfo -----------------------------------------------------------------------------

SYSINFO = (
    "import ctypes, os, struct\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "buf = ctypes.create_string_buffer(128)\n"
    "rc = libc.sysinfo(buf)\n"
    "err = ctypes.get_errno() if rc else 0\n"
    "total = struct.unpack_from('Q', buf.raw, 32)[0] * struct.unpack_from('I', buf.raw, 104)[0]\n"
    "procs = struct.unpack_from('H', buf.raw, 80)[0]\n"
    "try:\n"
    "    phys = os.sysconf('SC_PHYS_PAGES')\n"
    "except OSError as exc:\n"
    "    phys = exc.errno\n"
    "out = [rc, err, total if rc == 0 else None, procs if rc == 0 else None, phys,\n"
    "       os.sysconf('SC_PAGE_SIZE')]\n"
    "print(out)\n"
    "out"
)


def host_sysinfo() -> list[object]:
    control = run_unjailed(SYSINFO)
    assert control.returncode == 0, control.stderr
    return ast.literal_eval(control.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", SHIPPED)
def test_sysinfo_is_refused_and_sysconf_degrades(hostile: DaemonHandle, policy: str) -> None:
    rc, err, total, procs, phys, page = host_sysinfo()
    assert (rc, err) == (0, 0) and total and procs  # the host sees its memory and task count
    assert phys == total // page  # type: ignore[operator]
    r = hostile.run(SYSINFO, policy=policy)
    assert r.status == "ok", (r.status, r.error)  # failed, not killed: glibc calls it
    # os.sysconf would return stack garbage (glibc ignores sysinfo's failure): it raises
    assert r.result == [-1, errno.EPERM, None, None, errno.EPERM, page]


def test_sysinfo_shows_the_host_where_a_policy_allows_it(hostile: DaemonHandle) -> None:
    _, _, host_total, _, _, page = host_sysinfo()
    r = hostile.run(SYSINFO, policy=OPEN)
    assert r.status == "ok", (r.status, r.error)
    rc, err, total, procs, phys, _ = r.result
    assert (rc, err, total) == (0, 0, host_total)  # the host's RAM, seen from the jail
    assert procs > 0 and phys == host_total // page  # type: ignore[operator]


# ---- inotify and dnotify on the shared /usr ----------------------------------------------

def inotify_probe(trigger: str) -> str:
    return (
        "import ctypes, os, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.inotify_init1(os.O_NONBLOCK)\n"
        "if fd < 0:\n"
        "    out = ['refused', ctypes.get_errno()]\n"
        "else:\n"
        f"    assert libc.inotify_add_watch(fd, {WATCHED_DIR.encode()!r}, 0x20 | 0x1) > 0\n"
        f"    {trigger}\n"  # the open is queued before the trigger returns: no wait needed
        "    data, names, i = os.read(fd, 1 << 16), set(), 0\n"
        "    while i < len(data):\n"
        "        n = struct.unpack_from('iIII', data, i)[3]\n"
        "        names.add(data[i + 16:i + 16 + n].rstrip(b'\\0').decode())\n"
        "        i += 16 + n\n"
        "    out = ['watched', sorted(names)]\n"
        "print(out)\n"
        "out"
    )


def test_inotify_watches_the_host_where_the_protection_is_off(hostile: DaemonHandle) -> None:
    name = os.path.basename(WATCHED_FILE)
    control = run_unjailed(inotify_probe(f"open({WATCHED_FILE!r}, 'rb').read(4)"))
    assert control.returncode == 0, control.stderr
    assert name in ast.literal_eval(control.stdout)[1]
    r = hostile.run(inotify_probe("tools.touch()"), policy=OPEN, tools=HOST_TOOLS)
    assert r.status == "ok", (r.status, r.error)
    assert r.result[0] == "watched" and name in r.result[1]  # the jail saw the host's open


@pytest.mark.parametrize("policy", SHIPPED)
def test_inotify_is_refused(hostile: DaemonHandle, policy: str) -> None:
    r = hostile.run(inotify_probe("tools.touch()"), policy=policy, tools=HOST_TOOLS)
    assert (r.status, r.result) == ("ok", ["refused", errno.ENOSYS]), (r.status, r.error)


def dnotify_probe(trigger: str) -> str:
    return (
        "import fcntl, os, signal, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGIO, lambda signum, frame: seen.append(signum))\n"
        f"fd = os.open({WATCHED_DIR!r}, os.O_RDONLY)\n"
        "try:\n"
        "    fcntl.fcntl(fd, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)\n"
        "except OSError as exc:\n"
        "    out = ['refused', exc.errno]\n"
        "else:\n"
        f"    {trigger}\n"
        # the signal is queued before the trigger returns; Python runs its handler in the
        # main thread a moment later. The deadline is a liveness guard, not a measurement.
        f"    deadline = time.monotonic() + {guard(20)}\n"
        "    while not seen and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    out = ['notified', bool(seen)]\n"
        "print(out)\n"
        "out"
    )


def test_dnotify_signals_the_host_access_where_the_protection_is_off(hostile: DaemonHandle) -> None:
    control = run_unjailed(dnotify_probe(f"open({WATCHED_FILE!r}, 'rb').read(4)"))
    assert control.returncode == 0, control.stderr
    assert ast.literal_eval(control.stdout) == ["notified", True]
    r = hostile.run(dnotify_probe("tools.touch()"), policy=OPEN, tools=HOST_TOOLS)
    assert (r.status, r.result) == ("ok", ["notified", True]), (r.status, r.error)


@pytest.mark.parametrize("policy", SHIPPED)
def test_dnotify_is_refused(hostile: DaemonHandle, policy: str) -> None:
    r = hostile.run(dnotify_probe("tools.touch()"), policy=policy, tools=HOST_TOOLS)
    assert (r.status, r.result) == ("ok", ["refused", errno.EPERM]), (r.status, r.error)


# ---- locks on the shared /usr ------------------------------------------------------------

FLOCK = (
    "import fcntl, os\n"
    f"fd = os.open({SHARED_FILE!r}, os.O_RDONLY)\n"
    "try:\n"
    "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # exclusive, on a read-only file\n"
    "    mine = 'locked'\n"
    "except OSError as exc:\n"
    "    mine = exc.errno\n"
    "host = tools.host_flock()\n"
    "if mine == 'locked':\n"
    "    fcntl.flock(fd, fcntl.LOCK_UN)  # before the result: the next probe finds it free\n"
    "[mine, host]"
)


def test_a_jail_blocks_a_host_flock_where_the_protection_is_off(hostile: DaemonHandle) -> None:
    assert host_tries_flock() == "free"
    r = hostile.run(FLOCK, policy=OPEN, tools=HOST_TOOLS)
    assert (r.status, r.result) == ("ok", ["locked", "blocked"]), (r.status, r.error)
    assert host_tries_flock() == "free"  # the jail unlocked before it answered


@pytest.mark.parametrize("policy", SHIPPED)
def test_a_jail_cannot_flock_a_shared_file(hostile: DaemonHandle, policy: str) -> None:
    r = hostile.run(FLOCK, policy=policy, tools=HOST_TOOLS)
    # refused with ENOSYS (filelock then raises instead of retrying forever), and the host's
    # flock on the same file is free while the jail runs
    assert (r.status, r.result) == ("ok", [errno.ENOSYS, "free"]), (r.status, r.error)


@pytest.fixture
def host_read_lock() -> Iterator[None]:
    """This test process holds an OFD read lock on one byte of the shared file."""
    fd = os.open(SHARED_FILE, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                    struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, LOCK_OFFSET, 1, 0))
        yield
    finally:
        os.close(fd)


def lock_query(command: str) -> str:
    return (
        "import fcntl, os, struct\n"
        f"fd = os.open({SHARED_FILE!r}, os.O_RDONLY)\n"
        f"query = struct.pack('hhqqi4x', fcntl.F_WRLCK, os.SEEK_SET, {LOCK_OFFSET}, 1, 0)\n"
        "try:\n"
        f"    answer = fcntl.fcntl(fd, fcntl.{command}, query)\n"
        "    out = ['answered', struct.unpack('hhqqi4x', answer)[0] == fcntl.F_RDLCK]\n"
        "except OSError as exc:\n"
        "    out = ['refused', exc.errno]\n"
        # what stays open: taking a read lock (SQLite's F_SETLK); it cannot conflict with
        # another reader's, and a write lock needs the file open for writing
        f"fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, {LOCK_OFFSET + 1})\n"
        "print(out)\n"
        "out"
    )


@pytest.mark.usefixtures("host_read_lock")
@pytest.mark.parametrize("command", ["F_GETLK", "F_OFD_GETLK"])
def test_lock_queries_see_the_hosts_lock_where_the_protection_is_off(
        hostile: DaemonHandle, command: str) -> None:
    control = run_unjailed(lock_query(command))
    assert control.returncode == 0, control.stderr
    assert ast.literal_eval(control.stdout) == ["answered", True]
    r = hostile.run(lock_query(command), policy=OPEN)
    assert (r.status, r.result) == ("ok", ["answered", True]), (r.status, r.error)


@pytest.mark.usefixtures("host_read_lock")
@pytest.mark.parametrize("command", ["F_GETLK", "F_OFD_GETLK"])
@pytest.mark.parametrize("policy", SHIPPED)
def test_lock_queries_are_refused(hostile: DaemonHandle, policy: str, command: str) -> None:
    r = hostile.run(lock_query(command), policy=policy)
    assert (r.status, r.result) == ("ok", ["refused", errno.EPERM]), (r.status, r.error)


# ---- page cache: dropping the shared files' pages ----------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]


def host_resident_pages() -> int:
    """A tool handler: how many pages of the shared file are in the host's page cache (root
    sees the truth through mincore; the mapping is gone before it returns, so it pins none)."""
    fd = os.open(WATCHED_FILE, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            assert _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        finally:
            _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def host_loads_shared_file() -> int:
    """A tool handler: the host reads the shared file; its pages are then all cached."""
    Path(WATCHED_FILE).read_bytes()
    return host_resident_pages()


EVICT = (
    "import os\n"
    "cached = tools.load()\n"
    f"fd = os.open({WATCHED_FILE!r}, os.O_RDONLY)\n"
    "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # other advice stays open\n"
    "try:\n"
    "    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
    "    mine = 'dropped'\n"
    "except OSError as exc:\n"
    "    mine = exc.errno\n"
    "[cached, mine, tools.resident()]"
)
PAGE_TOOLS = {"load": host_loads_shared_file, "resident": host_resident_pages}


def test_a_jail_drops_the_hosts_page_cache_where_the_protection_is_off(
        hostile: DaemonHandle) -> None:
    pages = host_loads_shared_file()
    assert pages > 0
    control = run_unjailed(  # a host process can drop them
        f"import os\nfd = os.open({WATCHED_FILE!r}, os.O_RDONLY)\n"
        "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)")
    assert control.returncode == 0, control.stderr
    assert host_resident_pages() == 0
    r = hostile.run(EVICT, policy=OPEN, tools=PAGE_TOOLS)
    assert (r.status, r.result) == ("ok", [pages, "dropped", 0]), (r.status, r.error)


@pytest.mark.parametrize("policy", SHIPPED)
def test_a_jail_cannot_drop_the_hosts_page_cache(hostile: DaemonHandle, policy: str) -> None:
    pages = host_loads_shared_file()
    r = hostile.run(EVICT, policy=policy, tools=PAGE_TOOLS)
    assert (r.status, r.result) == ("ok", [pages, errno.EPERM, pages]), (r.status, r.error)


# ---- memfd: a binary run despite the noexec /tmp -----------------------------------------

MEMFD = (
    "import os, shutil, subprocess\n"
    "try:\n"
    "    fd = os.memfd_create('payload', 0)\n"
    "except OSError as exc:\n"
    "    out = ['refused', exc.errno]\n"
    "else:\n"
    "    with os.fdopen(os.dup(fd), 'wb') as f, open('/usr/bin/echo', 'rb') as src:\n"
    "        f.write(src.read())\n"
    "    r = subprocess.run([f'/proc/self/fd/{fd}', 'ran-from-memfd'], pass_fds=[fd],\n"
    "                       capture_output=True, text=True)\n"
    "    out = ['ran', r.stdout.strip()]\n"
    "print(out)\n"
    "out"
)
NOEXEC_TMP = (
    "import os, shutil, subprocess, tempfile\n"
    "path = shutil.copy('/usr/bin/echo', os.path.join(tempfile.gettempdir(), 'echo'))\n"
    "os.chmod(path, 0o755)\n"
    "try:\n"
    "    subprocess.run([path, 'x'], check=True)\n"
    "    out = 'ran'\n"
    "except PermissionError:\n"
    "    out = 'noexec'\n"
    "out"
)


def test_a_memfd_runs_a_binary_where_the_protection_is_off(hostile: DaemonHandle) -> None:
    control = run_unjailed(MEMFD)
    assert control.returncode == 0, control.stderr
    assert ast.literal_eval(control.stdout) == ["ran", "ran-from-memfd"]
    # in the jail /tmp is noexec, and a memfd was the way round it
    assert hostile.run(NOEXEC_TMP, policy=OPEN).result == "noexec"
    r = hostile.run(MEMFD, policy=OPEN)
    assert (r.status, r.result) == ("ok", ["ran", "ran-from-memfd"]), (r.status, r.error)


@pytest.mark.parametrize("policy", SHIPPED)
def test_memfd_create_is_refused(hostile: DaemonHandle, policy: str) -> None:
    r = hostile.run(MEMFD, policy=policy)
    assert (r.status, r.result) == ("ok", ["refused", errno.ENOSYS]), (r.status, r.error)


# ---- what the closed calls must not break ------------------------------------------------

WORKLOAD = (
    "import io, multiprocessing, os, sqlite3, tempfile\n"
    "import numpy as np, pandas as pd\n"
    "rng = np.random.default_rng(7)\n"
    "a = rng.random((200, 200))\n"
    "eig = float(np.linalg.eigvalsh(a @ a.T).max() > 0)\n"
    "df = pd.DataFrame({'k': rng.integers(0, 10, 5000), 'v': rng.random(5000)})\n"
    "means = df.groupby('k').v.mean().sort_values()\n"
    "back = pd.read_csv(io.StringIO(df.to_csv(index=False)))\n"
    "with multiprocessing.Pool(2) as pool:\n"
    "    squares = sum(pool.map(abs, range(-50, 50)))\n"
    "path = os.path.join(tempfile.gettempdir(), 'db.sqlite')\n"  # file locks: F_SETLK, open
    "with sqlite3.connect(path) as db:\n"
    "    db.execute('create table t (v real)')\n"
    "    db.executemany('insert into t values (?)', [(float(x),) for x in df.v[:100]])\n"
    "    rows = db.execute('select count(*) from t').fetchone()[0]\n"
    "[eig, len(means), len(back), squares, rows, os.sysconf('SC_PAGE_SIZE') > 0]"
)


def test_numpy_pandas_multiprocessing_and_sqlite_need_none_of_the_closed_calls(
        hostile: DaemonHandle) -> None:
    """The ``data`` policy's kind of job, under the ``kill`` action: a closed call that one of
    these made would fail it (or, for a call outside the profile, kill it)."""
    r = hostile.run(WORKLOAD, policy="data")
    assert (r.status, r.result) == ("ok", [1.0, 10, 5000, 2500, 100, True]), (r.status, r.error)
