"""The demo's output: every line the job prints is marked as the jail's."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO


def test_every_line_of_the_jails_output_is_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("jaild_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = demo.Prefixed("jail| ")
    for chunk in ("one\ntw", "o\n", "\nthree\nfour"):
        out(chunk)
    assert capsys.readouterr().out == "jail| one\njail| two\njail| \njail| three\njail| four"
