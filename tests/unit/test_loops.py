"""jaild.loops: which event loop jaild's own processes run on."""

from __future__ import annotations

import asyncio

import pytest

from jaild import extras, loops
from jaild.errors import MissingExtra


async def _kind() -> str:
    return loops.name(asyncio.get_running_loop())


def test_the_standard_loop_is_the_default_and_each_choice_is_honoured() -> None:
    # uvloop comes with the [test] extra (make setup), as with jaild[uvloop]
    assert loops.DEFAULT == "asyncio"
    assert loops.run(_kind()) == "asyncio"
    assert loops.run(_kind(), "auto") == "uvloop"
    assert loops.run(_kind(), "uvloop") == "uvloop"
    assert loops.run(_kind(), "asyncio") == "asyncio"
    loop = loops.new_event_loop("asyncio")
    try:
        assert loops.name(loop) == "asyncio"
    finally:
        loop.close()


def test_auto_falls_back_to_the_standard_loop_without_uvloop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert loops.run(_kind(), "auto") == "uvloop"  # the control: it is installed here
    monkeypatch.setitem(extras.EXTRAS, "uvloop", ("jaild_test_no_such_module",))
    assert loops.run(_kind(), "auto") == "asyncio"
    with pytest.raises(MissingExtra) as caught:
        loops.factory("uvloop")
    assert str(caught.value) == (
        "the event loop 'uvloop' needs jaild[uvloop]: pip install 'jaild[uvloop]'")


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'trio'"):
        loops.factory("trio")
