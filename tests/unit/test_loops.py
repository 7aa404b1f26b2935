"""jaild.loops: which event loop jaild's own processes run on."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from jaild import loops


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
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert loops.run(_kind(), "auto") == "asyncio"
    with pytest.raises(ImportError):
        loops.factory("uvloop")


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'trio'"):
        loops.factory("trio")
