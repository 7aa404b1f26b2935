"""The runtime's execution rules, in-process (the jail adds nothing to these rules)."""

from __future__ import annotations

import builtins
from typing import Any

from jaild.protocol import unpack
from jaild.runtime.execute import Outcome, pack_result, run


def execute(code: str, limit: int = 1 << 20) -> Outcome:
    return run(code, "<job>", {"__name__": "__main__", "__builtins__": builtins}, limit)


def result(code: str) -> Any:
    out = execute(code)
    assert out.ok, out.error
    assert out.result is not None
    return unpack(out.result)


def test_result_rules() -> None:
    assert result("1 + 1") == 2
    assert result("x = 1") is None
    assert result("def main():\n    return 'm'\n'last'") == "m"
    assert result("async def main():\n    return 'am'") == "am"
    assert result("def main(required):\n    return 1\n'last'") == "last"
    assert result("def main(optional=2):\n    return optional") == 2
    assert result("import asyncio\nawait asyncio.sleep(0)\n'top'") == "top"
    assert result("import asyncio\nasync def f():\n    return 3\nawait f()") == 3


def test_one_event_loop_for_top_level_and_main() -> None:
    code = (
        "import asyncio\n"
        "loop = asyncio.get_running_loop() if False else None\n"
        "async def grab():\n    return asyncio.get_running_loop()\n"
        "first = await grab()\n"
        "async def main():\n    return (await grab()) is first\n"
    )
    assert result(code) is True


def test_main_defined_elsewhere_is_not_called() -> None:
    # a `main` imported from a module is not the user's entry point
    assert result("from os.path import join as main\n'kept'") == "kept"


def test_errors_carry_type_message_line_and_user_traceback() -> None:
    out = execute("a = 1\n\ndef f():\n    return 1 / 0\nf()")
    assert not out.ok and out.error is not None
    assert (out.error.type, out.error.message, out.error.lineno) == ("ZeroDivisionError", "division by zero", 4)
    assert "return 1 / 0" in out.error.traceback
    assert "execute.py" not in out.error.traceback


def test_syntax_error_inside_the_runtime_path() -> None:
    out = execute("def (:")
    assert out.error is not None and out.error.type == "SyntaxError" and out.error.lineno == 1


def test_system_exit() -> None:
    assert execute("import sys\nsys.exit()").ok
    assert execute("raise SystemExit(0)").ok
    bad = execute("raise SystemExit('reason')")
    assert not bad.ok and bad.error is not None and bad.error.type == "SystemExit"


def test_keyboard_interrupt_and_base_exceptions_are_reported() -> None:
    out = execute("raise KeyboardInterrupt")
    assert out.error is not None and out.error.type == "KeyboardInterrupt"


def test_weird_exceptions_do_not_break_reporting() -> None:
    code = "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')\nraise E()"
    out = execute(code)
    assert out.error is not None and out.error.type == "E"
    assert "str() of the exception failed" in out.error.message


def test_pack_result_fallbacks() -> None:
    packed, err = pack_result({1, 2}, 1024)
    assert err is None and packed is not None and sorted(unpack(packed)) == [1, 2]
    packed, err = pack_result({(1, 2): 3}, 1024)
    assert unpack(packed or b"") == "{(1, 2): 3}"
    packed, err = pack_result(10**30, 1024)
    assert unpack(packed or b"") == str(10**30)

    class Bad:
        def __repr__(self) -> str:
            raise ValueError

    packed, err = pack_result(Bad(), 1024)
    assert unpack(packed or b"") == "<unrepresentable result>"
    packed, err = pack_result("x" * 2000, 1024)
    assert packed is None and err is not None and err.type == "ResultTooLarge"


def numpy_like(module: str, ndim: int, item: object, shown: str) -> object:
    """An object of numpy's shape (``.ndim``, ``.item()``, a type of module ``module``);
    numpy itself is not in the dev venv (a real one is: tests/integration/test_jobs.py)."""

    def take(self: object) -> object:
        if isinstance(item, Exception):
            raise item
        return item

    kind = type("int64", (), {"__module__": module, "ndim": ndim, "item": take,
                               "__repr__": lambda self: shown})
    return kind()


def test_numpy_scalars_and_0d_arrays_come_back_as_plain_values() -> None:
    def packed(value: object) -> object:
        data, err = pack_result(value, 1024)
        assert err is None and data is not None
        return unpack(data)

    # the control: a type of another module is msgpack's unknown, given as its repr
    assert packed(numpy_like("elsewhere", 0, 6, "np.int64(6)")) == "np.int64(6)"
    assert packed(numpy_like("numpy", 0, 6, "np.int64(6)")) == 6
    assert packed({"n": [numpy_like("numpy", 0, True, "np.True_")]}) == {"n": [True]}
    assert packed(numpy_like("numpy", 0, 2.5, "array(2.5)")) == 2.5
    assert packed(numpy_like("numpy", 0, (1 << 64) - 1, "np.uint64(...)")) == (1 << 64) - 1
    # what is not a plain bool, number or string stays a repr: arrays, complex, datetimes,
    # an object array's object, ints msgpack cannot carry, an .item() that fails
    assert packed(numpy_like("numpy", 1, 1, "array([1])")) == "array([1])"
    assert packed(numpy_like("numpy", 0, 1j, "np.complex128(1j)")) == "np.complex128(1j)"
    assert packed(numpy_like("numpy", 0, None, "array(None, dtype=object)")) == (
        "array(None, dtype=object)")
    assert packed(numpy_like("numpy", 0, 1 << 64, "array(big)")) == "array(big)"
    assert packed(numpy_like("numpy", 0, ValueError("no"), "odd")) == "odd"


def test_long_messages_are_clipped() -> None:
    out = execute("raise ValueError('x' * 200000)")
    assert out.error is not None and len(out.error.message) <= 65536


def test_a_traceback_holds_no_frame_of_jaild_itself() -> None:
    """A call into the runtime that raises (here the tools proxy, as ``await
    tools.missing()`` does in a jail) shows the user's line, not the runtime's frames --
    also in an exception chained to it."""
    from jaild.runtime.tools import Tools

    tools = Tools((), channel=None, payload_limit=1024)  # type: ignore[arg-type]  # no tool
    glb = {"__name__": "__main__", "__builtins__": builtins, "tools": tools}
    out = run("def f():\n    tools.missing\ntry:\n    f()\nexcept Exception as e:\n"
              "    raise RuntimeError('again') from e\n", "<job>", glb, 1 << 20)
    assert out.error is not None and out.error.type == "RuntimeError"
    text = out.error.traceback
    assert "tools.missing" in text and "raise RuntimeError('again') from e" in text, text
    assert "jaild/runtime" not in text and "tools.py" not in text, text
