"""The real-host harness names what failed in its own output (all CI keeps of a guest run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO


def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("jaild_hosts_run", REPO / "hosts" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_steps_tests_and_log_tail_are_reported(tmp_path: Path) -> None:
    run = harness()
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok" time="1"/>'
        '<testcase classname="tests.b" name="test_bad" time="2">'
        '<failure message="AssertionError: no&#10;second line">trace</failure></testcase>'
        '<testcase classname="tests.c" name="test_err" time="2"><error message="">x</error>'
        "</testcase></testsuite></testsuites>"
    )
    (tmp_path / "test.log").write_text("".join(f"line {i}\n" for i in range(100)))
    lines = run.failure_excerpt(tmp_path, "test")
    assert lines[:2] == ["FAILED tests.b::test_bad: AssertionError: no", "FAILED tests.c::test_err"]
    assert lines[2:] == [f"test.log: line {i}" for i in range(100 - run.EXCERPT_LINES, 100)]
    (tmp_path / "junit.xml").write_text("<not xml")
    assert run.failure_excerpt(tmp_path, "test")[0].startswith("(cannot read junit.xml: ")
    assert run.failure_excerpt(tmp_path, "socket") == []  # no log, no JUnit file
