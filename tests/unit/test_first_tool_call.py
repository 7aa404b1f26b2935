"""What a client's first tool call used to do on its own clock is done ahead (issue 45,
item 7): the client's worker thread (jaild.toolhost), the daemon's jsonschema (admission).
The mechanisms are tested here; bench/first_call.py measures the times."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from jaild.toolhost import ToolHost
from jaild.toolspec import normalize_tools

REPO = Path(__file__).resolve().parent.parent.parent


def plain(a: int) -> int:
    return a


async def awaited(a: int) -> int:
    return a


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("jaild-tool")}


def test_a_job_with_a_plain_handler_starts_the_worker_thread_before_its_first_call() -> None:
    host = ToolHost(4)
    before = _workers()
    try:
        host.prepare(normalize_tools({"a": awaited}).values())  # async only: no thread
        assert not host.prepared and _workers() == before
        host.prepare(normalize_tools({"a": awaited}).values(), approve=lambda *_: True)
        assert host.prepared and len(_workers() - before) == 1  # a plain approve callback
        host.prepare(normalize_tools({"p": plain}).values())  # once is enough
        assert len(_workers() - before) == 1
    finally:
        host.close()
    host = ToolHost(4)
    try:
        host.prepare(normalize_tools({"p": plain}).values())
        assert host.prepared and len(_workers() - before) >= 1
    finally:
        host.close()


def test_the_tool_host_imports_its_thread_pool_with_itself() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, jaild.toolhost\n"
         "print('concurrent.futures.thread' in sys.modules)"],
        capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    assert out.stdout.strip() == "True"


def test_schema_checks_are_ready_once_prepared() -> None:
    """After prepare_schema_checks (the daemon's start), checking a client's new schema
    imports nothing (positive control: before it, the first check imports jsonschema)."""
    code = (
        "import sys\n"
        "from jaild.daemon.core import admission\n"
        "assert 'jsonschema' not in sys.modules\n"
        "CONTROL\n"
        "before = set(sys.modules)\n"
        "assert admission.check_schema({'type': 'object', 'properties': "
        "{'q': {'type': 'string'}}}) is None\n"
        "print(sorted(n for n in set(sys.modules) - before if n.startswith('jsonschema')))\n"
    )
    prepared = subprocess.run(
        [sys.executable, "-c", code.replace("CONTROL", "admission.prepare_schema_checks()")],
        capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    assert prepared.stdout.strip() == "[]"
    control = subprocess.run([sys.executable, "-c", code.replace("CONTROL", "")],
                             capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    assert "jsonschema" in control.stdout
