"""Orphan reaping after each job: an exited child that no live job or zygote owns is
reaped; a tracked one is left to its owner; and when no child has exited, the /proc child
lists are not read at all (the per-job cost is one ``waitid``).

Each case runs in a fresh interpreter, so no other test's children are in the way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import guard

PRELUDE = textwrap.dedent("""
    import json, os, time
    from types import SimpleNamespace
    from jaild.daemon import pipeline

    def pipe(tracked=(), zygotes=()):
        # a pipeline with what reaping reads: the registry's pids and the zygotes'
        registry = SimpleNamespace(pids=lambda: iter(tracked))
        env = SimpleNamespace(zygotes=SimpleNamespace(pids=lambda: set(zygotes)))
        served = SimpleNamespace(env=env)
        return pipeline.Pipeline(None, registry, None, served, None, None)

    def exited_child():
        pid = os.posix_spawn("/bin/true", ["true"], {})
        while True:  # until it is a zombie (nothing reaps it)
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                return pid
            time.sleep(0.001)

    def zombie(pid):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
""")


def run(body: str) -> object:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=guard(60), check=True,
    )
    return json.loads(out.stdout)


def test_an_exited_untracked_child_is_reaped() -> None:
    got = run("""
        pid = exited_child()
        reaped = pipe().reap_orphans()
        print(json.dumps([pid in reaped, os.path.exists(f"/proc/{pid}")]))
    """)
    assert got == [True, False]


def test_a_tracked_child_is_left_to_its_owner() -> None:
    # a job's nsjail and a zygote's: their exit status is read by whoever watches them
    got = run("""
        job, zyg, orphan = exited_child(), exited_child(), exited_child()
        reaped = pipe(tracked=[job], zygotes=[zyg]).reap_orphans()
        print(json.dumps([reaped, zombie(job), zombie(zyg), orphan]))
    """)
    reaped, job_zombie, zygote_zombie, orphan = got  # type: ignore[misc]
    assert reaped == [orphan]
    assert job_zombie and zygote_zombie


def test_with_no_exited_child_the_proc_child_lists_are_not_read() -> None:
    got = run("""
        def read_proc():
            raise AssertionError("read /proc")
        pipeline._children = read_proc
        alive = os.posix_spawn("/bin/sleep", ["sleep", "60"], {})
        none_exited = pipe().reap_orphans()
        os.kill(alive, 9)
        print(json.dumps([none_exited, alive]))
    """)
    assert got[0] == []  # type: ignore[index]


def test_positive_control_an_exited_child_makes_it_read_them() -> None:
    got = run("""
        calls = []
        children = pipeline._children
        def read_proc():
            calls.append(1)
            return children()
        pipeline._children = read_proc
        pid = exited_child()
        reaped = pipe().reap_orphans()
        print(json.dumps([len(calls), reaped == [pid]]))
    """)
    assert got == [1, True]
