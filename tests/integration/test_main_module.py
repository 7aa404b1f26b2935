"""A job's code runs as the ``__main__`` module, through the real daemon: what it defines
pickles by reference, so ``multiprocessing`` maps a function the job defines, in a job, in a
session's later run, and in a session restored from a snapshot (a fork)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jaild.client import Client
from tests.conftest import DaemonHandle, start_daemon, sweep_cgroups

pytestmark = pytest.mark.integration

POOL_MAP = (
    "import multiprocessing\n"
    "with multiprocessing.Pool(2) as pool:\n"
    "    squares = pool.map(f, range(8))\n"
    "del pool\n"  # a pool cannot be pickled: a session's snapshot would refuse it
    "squares\n"
)
DEFINE_F = "def f(x):\n    return x * x\n"
SQUARES = [x * x for x in range(8)]


def test_a_pool_maps_a_function_the_job_defines(client: Client) -> None:
    r = client.run(
        DEFINE_F
        + "import sys\n"
        + "assert sys.modules['__main__'].f is f and f.__module__ == '__main__'\n"
        + "ran = []\n"
        + "if __name__ == '__main__':\n"
        + "    ran.append('main block')\n"
        + POOL_MAP.replace("squares\n", "[squares, ran]\n"),
        timeout=30,
    )
    assert (r.status, r.error) == ("ok", None), r.stderr
    assert r.result == [SQUARES, ["main block"]]


def test_a_job_pickles_its_own_class_instance(client: Client) -> None:
    r = client.run(
        "import pickle\n"
        "class Point:\n"
        "    def __init__(self, x, y):\n"
        "        self.x, self.y = x, y\n"
        "p = pickle.loads(pickle.dumps(Point(3, 4)))\n"
        "[type(p) is Point, p.x, p.y]\n",
        timeout=30,
    )
    assert (r.status, r.error, r.result) == ("ok", None, [True, 3, 4]), r.stderr


@pytest.fixture(scope="module")
def snap_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A daemon serving one policy, sessions' jails made for them (as tests/integration/
    test_snapshots.py's)."""
    handle = start_daemon(tmp_path_factory.mktemp("main-module"), {"snap": "[pool]\nmax = 0\n"},
                          with_repo_policies=False)
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


def test_a_session_pool_maps_what_an_earlier_run_defined_and_so_does_its_fork(
    snap_daemon: DaemonHandle,
) -> None:
    with Client(snap_daemon.socket) as c, c.session("snap") as s:
        assert s.run(DEFINE_F + "base = 1\ndef h():\n    return base + f(2)\n").status == "ok"
        r = s.run(POOL_MAP, timeout=30)
        assert (r.status, r.error, r.result) == ("ok", None, SQUARES), r.stderr
        (fork,) = s.fork(1)  # a snapshot restored in a fresh jail (open: no `with`)
        try:
            r = fork.run(
                "import sys\n"
                "assert sys.modules['__main__'].f is f and f.__globals__ is globals()\n"
                + POOL_MAP,
                timeout=30,
            )
            assert (r.status, r.error, r.result) == ("ok", None, SQUARES), r.stderr
            # a restored function reads the namespace the later runs assign to, as before
            r = fork.run("base = 5\nh()\n")
            assert (r.status, r.result) == ("ok", 9)
        finally:
            fork.close()
