"""One tenant's redaction does not stall another tenant's job.

Redaction of a run's result and output scans it for every secret the job read; a tenant can
make that as heavy as its budget allows. It runs in a worker thread, off the daemon's event
loop, so every other job goes on meanwhile. Shown structurally, not by timing: the daemon
(the real core with :mod:`jaild.testing`'s jails, on a thread of this process, its socket
reachable by uid 65534) runs root's job, whose redaction is *held* by a hook until uid
65534's job -- the real client library, run as that uid -- has ended. With redaction off
the loop, uid 65534's job ends while root's redaction is held; root's record then comes,
redacted. The positive control does root's redaction on the event loop (as it was done,
inside the run's end): uid 65534's job cannot end while it is held -- the hook gives up
waiting, unreleased, and only then is uid 65534 served.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from jaild.client import Client
from jaild.daemon.jails import job as job_module
from jaild.daemon.jails.job import JailedJob
from jaild.testing import daemon_thread
from tests.conftest import ForeignClient, guard

POLICY = """
[limits]
wall_time_s = 120
tool_call_timeout_s = 60
[[flow.source]]
tool = "read_rows"
labels = ["pii"]
[[flow.sink]]
label = "pii"
result = "redact"
output = "redact"
"""

HEAVY = "rows = tools.read_rows()\nprint('\\n'.join(rows * 20))\nrows"
"""Root's job: 2,000 labelled strings, printed 20 times over, and returned."""

OTHER_UID = 65534
OTHER = (
    "import json, sys\nfrom jaild.client import Client\n"
    "with Client(sys.argv[1]) as c:\n"
    "    r = c.run('6 * 7')\n"
    "print(json.dumps({'status': r.status, 'result': r.result}))\n"
)


def read_rows() -> list[str]:
    return [f"customer-{i:05d}" for i in range(2000)]


class Hold:
    """Wraps :func:`jaild.daemon.jails.job._redact_run`: tells when a redaction started,
    and holds it until released (or ``wait_s``, a liveness bound: then unreleased)."""

    def __init__(self, wait_s: float) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.wait_s = wait_s
        self.released: bool | None = None  # was it released while held?

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any) -> Any:
            self.started.set()
            self.released = self.release.wait(self.wait_s)
            return real(*args)
        return held


async def _redact_on_the_loop(self: JailedJob, ended: Any) -> Any:
    """The control's :meth:`JailedJob._settle`: the redaction inside the event loop."""
    if not isinstance(ended, job_module._Unredacted):
        return ended
    _, record, result = job_module._redact_run(ended, guard(60))
    if ended.final:
        self._run.result = result
    return record, result, ended.downloads


def race(foreign: ForeignClient, monkeypatch: pytest.MonkeyPatch, hold: Hold
         ) -> tuple[dict[str, Any], Any]:
    """Root's heavy job, held in its redaction; meanwhile uid 65534's job. Returns uid
    65534's answer and root's result."""
    monkeypatch.setattr(job_module, "_redact_run", hold.wrap(job_module._redact_run))
    with daemon_thread({"default": POLICY}) as d:
        os.chmod(os.path.dirname(d.socket_path), 0o755)  # uid 65534 may reach it
        os.chmod(d.socket_path, 0o777)
        with Client(d.socket_path) as root:
            heavy = root.submit(HEAVY, tools=[read_rows])
            assert hold.started.wait(guard(60)), "root's run never reached its redaction"
            out = foreign.run(OTHER, d.socket_path, uid=OTHER_UID, gid=OTHER_UID)
            hold.release.set()
            assert out.returncode == 0, out.stderr
            r = heavy.result(guard(60))
    assert r.status == "ok", r.error
    assert r.stdout.count("[redacted:pii]") == 40_000 and "customer-" not in r.stdout
    return json.loads(out.stdout), r.result


def test_another_tenants_job_ends_while_a_redaction_runs(
        foreign_client: ForeignClient, monkeypatch: pytest.MonkeyPatch) -> None:
    hold = Hold(wait_s=guard(120))
    other, result = race(foreign_client, monkeypatch, hold)
    assert other == {"status": "ok", "result": 42}
    assert hold.released is True  # uid 65534's job ended while root's redaction was held
    assert result == ["[redacted:pii]"] * 2000


def test_positive_control_redaction_on_the_event_loop_stalls_the_other_tenant(
        foreign_client: ForeignClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JailedJob, "_settle", _redact_on_the_loop)
    hold = Hold(wait_s=2.0)  # how long does not matter: nothing is served while it holds
    other, result = race(foreign_client, monkeypatch, hold)
    assert other == {"status": "ok", "result": 42}  # served -- once the hold gave up
    assert hold.released is False  # never while root's redaction held the loop
    assert result == ["[redacted:pii]"] * 2000
