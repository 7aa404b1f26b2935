"""A daemon readies jsonschema at its start, not on the clock of the first job that brings
tools (issue 45, item 7: a new user's first such job took ~0.2 s more than the next)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from jaild.client import Client
from tests.conftest import DaemonHandle, guard, policy_texts

pytestmark = pytest.mark.integration


def _mapped(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return name in maps.read()


def test_a_ready_daemon_has_jsonschema_before_any_job_brings_tools(
    private_daemon: Callable[..., DaemonHandle],
) -> None:
    d = private_daemon(policy_texts("default"), with_repo_policies=False)
    deadline = time.monotonic() + guard(120)
    while True:  # it answers while it starts; a client learns whether it still does
        with Client(d.socket) as c:
            if c.starting is None:
                break
        assert time.monotonic() < deadline, "the daemon did not finish starting"
        time.sleep(0.05)
    # jsonschema's resolver (referencing) is built on rpds, a compiled extension: mapped
    # into the daemon only once jsonschema was imported. No job has run here yet.
    assert _mapped(d.proc.pid, "rpds"), "jsonschema was not imported at the daemon's start"
