"""Resource exhaustion: every attempt ends exactly as the policy says, and the daemon serves on.

Policy ``tiny``: 5 s wall, 10 s CPU, 64 MB, 16 pids, 4 KB output, 1 MB files, 64 fds, 8 MB
/tmp. What the kernel refuses (an errno the job sees) runs on ``refusals``, tiny with room in
time (tests/hostile/conftest.py), so a slow host's CPU never decides those.
Each case has a control: the same work, scaled down to fit the limits, succeeds.
"""

from __future__ import annotations

import errno

import pytest

from tests.conftest import DaemonHandle

pytestmark = pytest.mark.integration

CASES = [
    # name, the attack, status, error type or errno result, a version that fits
    ("busy loop", "while True:\n    pass", "timeout", "Timeout",
     "for _ in range(10**5):\n    pass"),
    ("sleep forever", "import time\nwhile True:\n    time.sleep(1)", "timeout", "Timeout",
     "import time\ntime.sleep(0.01)"),
    ("threads burning CPU", "import threading, time\ndef burn():\n    while True:\n        pass\n[threading.Thread(target=burn, daemon=True).start() for _ in range(4)]\ntime.sleep(10)",
     "timeout", "Timeout", "import threading\nt = threading.Thread(target=sum, args=(range(10),))\nt.start()\nt.join()"),
    ("memory bomb", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))", "memory_limit", "MemoryLimit",
     "x = bytearray(8 << 20)"),
    ("stdout flood", "while True:\n    print('x' * 1000)", "output_limit", "OutputLimit",
     "print('x' * 1000)"),
    ("stderr flood", "import sys\nwhile True:\n    sys.stderr.write('x' * 1000)", "output_limit",
     "OutputLimit", "import sys\nsys.stderr.write('x' * 1000)"),
    ("stdout flood without newlines", "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
     "output_limit", "OutputLimit", "import os\nos.write(1, b'x' * 100)"),
]


@pytest.mark.parametrize(("name", "attack", "status", "error_type", "fits"), CASES,
                         ids=[c[0] for c in CASES])
def test_exhaustion_ends_with_the_right_status(hostile: DaemonHandle, name: str, attack: str,
                                                status: str, error_type: str, fits: str) -> None:
    control = hostile.run(fits, policy="tiny")
    assert control.status == "ok", (control.status, control.error)
    r = hostile.run(attack, policy="tiny")
    assert r.status == status, (r.status, r.error)
    assert r.error is not None and r.error["type"] == error_type
    hostile.assert_serving()


ERRNO_CASES = [
    ("fork bomb", "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)",
     errno.EAGAIN, "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)"),
    ("tmpfs fill", "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (900 << 10))\n    i += 1",
     errno.ENOSPC, "open('/tmp/f', 'wb').write(b'x' * (900 << 10))"),
    ("inode fill", "i = 0\nwhile True:\n    open(f'/tmp/{i}', 'w').close()\n    i += 1",
     errno.ENOSPC, "[open(f'/tmp/{i}', 'w').close() for i in range(100)]"),
    ("big file", "open('/tmp/big', 'wb').write(b'x' * (4 << 20))", errno.EFBIG,
     "open('/tmp/big', 'wb').write(b'x' * (512 << 10))"),
    ("/dev/shm fill", "i = 0\nwhile True:\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * (900 << 10))\n    i += 1",
     errno.ENOSPC, "open('/dev/shm/f', 'wb').write(b'x' * (900 << 10))"),
    ("fd exhaustion", "fds = []\nwhile True:\n    fds.append(open('/dev/null'))", errno.EMFILE,
     "fds = [open('/dev/null') for _ in range(20)]"),
]


@pytest.mark.parametrize(("name", "attack", "expected_errno", "fits"), ERRNO_CASES,
                         ids=[c[0] for c in ERRNO_CASES])
def test_exhaustion_is_refused_by_the_kernel(hostile: DaemonHandle, name: str, attack: str,
                                             expected_errno: int, fits: str) -> None:
    assert hostile.run(fits, policy="refusals").status == "ok"
    wrapped = (
        "try:\n" + "".join(f"    {line}\n" for line in attack.splitlines())
        + "except OSError as e:\n    result = e.errno\nresult"
    )
    r = hostile.run(wrapped, policy="refusals")
    assert (r.status, r.result) == ("ok", expected_errno), (r.status, r.error)
    hostile.assert_serving()


def test_thread_bomb(hostile: DaemonHandle) -> None:
    code = (
        "import threading, time\nn = 0\ntry:\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        n += 1\nexcept RuntimeError as e:\n    result = (n, str(e))\nresult"
    )
    r = hostile.run(code, policy="refusals")
    assert r.status == "ok"
    assert 2 <= r.result[0] < 16 and "can't start new thread" in r.result[1]
    hostile.assert_serving()


@pytest.mark.parametrize("bomb", [
    ERRNO_CASES[0][1],  # the fork bomb: os.fork() raises BlockingIOError (EAGAIN)
    "import threading, time\nwhile True:\n"
    "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
], ids=["fork bomb", "thread bomb"])
def test_a_bomb_left_uncaught_names_the_pids_limit(hostile: DaemonHandle, bomb: str) -> None:
    """The kernel refuses a process or thread at ``limits.pids`` with a bare EAGAIN; the
    record's error keeps the exception's type (what the code could catch) and says which
    limit, how high, when the job's pids cgroup peaked at it."""
    r = hostile.run(bomb, policy="refusals")
    assert r.status == "error" and r.error is not None, (r.status, r.error)
    assert r.error["type"] in ("BlockingIOError", "RuntimeError"), r.error
    limit = f"limits.pids = {r.limits['pids']}"
    assert r.usage["pids_peak"] in (None, r.limits["pids"])
    if r.usage["pids_peak"] is not None:  # a kernel with pids.peak (6.1 on)
        assert limit in r.error["message"] and limit in r.error["traceback"], r.error
    # the control: the same exception type under the limit (a non-blocking pipe with nothing
    # in it) is the code's own, and comes back as it was raised
    r = hostile.run("import os\nr, w = os.pipe()\nos.set_blocking(r, False)\nos.read(r, 1)",
                    policy="refusals")
    assert r.status == "error" and r.error is not None
    assert r.error["type"] == "BlockingIOError" and "limits.pids" not in r.error["message"]
    assert "Errno 11" in r.error["message"]
    hostile.assert_serving()
