"""Run the user's code and describe what happened.

* Top-level ``await`` works (``PyCF_ALLOW_TOP_LEVEL_AWAIT``). Code without
  awaits runs as plain synchronous code, so blocking tool calls work there.
* If the code defines ``main`` (sync or async, no required arguments), it is
  called and its return value is the result; otherwise the value of a final
  expression statement is the result.
* One event loop serves the whole job (top level and ``main``).
* Values msgpack cannot carry are converted per object (:func:`jaild.protocol.pack`): sets
  become lists, numpy scalars and 0-d arrays the number or string they hold, the rest
  their ``repr``.
* Tracebacks show the user's frames only, with the user's source lines.
* The code runs as the ``__main__`` module (:func:`main_namespace`): its namespace is
  ``sys.modules["__main__"].__dict__``, so what it defines pickles by reference as a script's
  does (``multiprocessing.Pool().map(f, ...)``, ``pickle.dumps(instance)``), and
  ``if __name__ == "__main__":`` blocks run.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import linecache
import os
import sys
import traceback
import types
from dataclasses import dataclass
from types import CodeType, TracebackType
from typing import Any

from jaild.protocol import pack, unpack
from jaild.protocol.messages import MAX_MESSAGE_CHARS, ErrorInfo, safe_text
from jaild.runtime import tools

CO_COROUTINE = inspect.CO_COROUTINE
_FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


@dataclass
class Outcome:
    ok: bool
    result: bytes | None = None
    error: ErrorInfo | None = None


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return safe_text(text, limit)


def _user_frames(tb: TracebackType | None, filename: str) -> TracebackType | None:
    """Skip the runtime's own frames at the top of a traceback."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename != filename:
        start = start.tb_next
    return start if start is not None else tb


_JAILD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The jaild package the runtime runs from (``/opt/jaild/runtime/jaild/`` in a jail)."""


def _without_jaild_frames(shown: traceback.TracebackException) -> None:
    """Drop the runtime's own frames (the tools proxy raising ``ToolError``, ...) from a
    traceback and from the exceptions chained to it: the user sees their code and the
    libraries it called, not jaild's internals. A traceback of jaild's frames only (a fault
    of the runtime itself) is left whole."""
    seen: set[int] = set()
    todo: list[traceback.TracebackException | None] = [shown]
    while todo:
        te = todo.pop()
        if te is None or id(te) in seen:
            continue
        seen.add(id(te))
        kept = [f for f in te.stack if not (f.filename or "").startswith(_JAILD_DIR)]
        if kept:
            te.stack = traceback.StackSummary.from_list(kept)
        todo += [te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or [])]


def _last_user_line(tb: TracebackType | None, filename: str) -> int | None:
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def describe(exc: BaseException, filename: str) -> ErrorInfo:
    """ErrorInfo for an exception raised by user code."""
    if isinstance(exc, SyntaxError) and exc.filename == filename:
        text = "".join(traceback.format_exception_only(type(exc), exc))
        return ErrorInfo(
            type=_clip(type(exc).__name__, 256) or "SyntaxError",
            message=_clip(exc.msg or str(exc)),
            traceback=_clip(text),
            lineno=exc.lineno,
        )
    tb = _user_frames(exc.__traceback__, filename)
    try:
        shown = traceback.TracebackException(type(exc), exc, tb, compact=True)
        _without_jaild_frames(shown)
        text = "".join(shown.format())
    except Exception:
        text = f"{type(exc).__name__}: <traceback unavailable>"
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    return ErrorInfo(
        type=_clip(type(exc).__name__, 256) or "Exception",
        message=_clip(message),
        traceback=_clip(text),
        lineno=_last_user_line(exc.__traceback__, filename),
    )


def pack_result(value: Any, limit: int) -> tuple[bytes | None, ErrorInfo | None]:
    """Pack a result, falling back to repr; refuse it if it exceeds ``limit`` bytes."""
    try:
        packed = pack(value)
        unpack(packed)  # exactly what the client will do: tuple keys etc. must survive
    except Exception:
        try:
            packed = pack(repr(value))
        except Exception:
            packed = pack("<unrepresentable result>")
    if len(packed) > limit:
        return None, ErrorInfo(
            type="ResultTooLarge",
            message=f"the result is {len(packed)} bytes packed; the policy allows {limit}",
        )
    return packed, None


def _split(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop()
        assert isinstance(last, ast.Expr)
        return tree, ast.Expression(body=last.value)
    return tree, None


def _user_main(namespace: dict[str, Any], filename: str) -> Any:
    main = namespace.get("main")
    if not inspect.isfunction(main) or main.__code__.co_filename != filename:
        return None
    try:
        params = inspect.signature(main).parameters.values()
    except (TypeError, ValueError):
        return None
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return None if required else main


def main_namespace(names: dict[str, Any]) -> dict[str, Any]:
    """A fresh ``__main__`` module, put in ``sys.modules`` in place of the runtime's own
    (the bootstrap's, or the zygote's): the namespace the job's code runs in is its
    ``__dict__``, holding ``names`` (the runtime's: ``tools``, ...) and the module's own
    ``__name__`` (``"__main__"``), ``__doc__``, ``__spec__``, ... .

    ``pickle`` (and so ``multiprocessing``) pickles a function or class by its module and
    name and checks that ``sys.modules[module].name`` is that object: with the job's
    namespace a dict of its own, every function the job defined failed that check
    ("attribute lookup f on __main__ failed"). Each jail makes its own, so nothing of
    another job's ``__main__`` (the zygote's, a pooled jail's warm-up) is in it."""
    module = types.ModuleType("__main__")
    namespace = module.__dict__
    namespace.update(names)
    sys.modules["__main__"] = module
    return namespace


class SessionLoop:
    """The one event loop of a session's runs: tasks, locks and queues made by one run still
    work in the next (a loop per run would strand them). Made on first use."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        return self.loop


def run(
    code: str,
    filename: str,
    namespace: dict[str, Any],
    result_limit: int,
    session: SessionLoop | None = None,
) -> Outcome:
    """Execute ``code`` in ``namespace``; never raises.

    ``session``: the namespace is a session's, kept across runs; its event loop too. A
    ``main`` is called only if this run's code (re)defined it."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    loop: asyncio.AbstractEventLoop | None = None
    main_before = namespace.get("main")

    def await_in_loop(awaitable: Any) -> Any:
        nonlocal loop
        if session is not None:
            return session.get().run_until_complete(awaitable)
        if loop is None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
        return loop.run_until_complete(awaitable)

    def execute(code_obj: CodeType, mode: str) -> Any:
        if code_obj.co_flags & CO_COROUTINE:
            return await_in_loop(eval(code_obj, namespace))
        return eval(code_obj, namespace) if mode == "eval" else exec(code_obj, namespace)

    try:
        try:
            tree = ast.parse(code, filename, mode="exec")
            body, last = _split(tree)
            body_code = compile(body, filename, "exec", flags=_FLAGS, dont_inherit=True)
            last_code = (
                compile(last, filename, "eval", flags=_FLAGS, dont_inherit=True) if last else None
            )
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            return Outcome(ok=False, error=describe(exc, filename))
        execute(body_code, "exec")
        value = execute(last_code, "eval") if last_code is not None else None
        main = _user_main(namespace, filename)
        if main is not None and (session is None or main is not main_before):
            value = main()
            if inspect.isawaitable(value):
                value = await_in_loop(value)
        tools.refuse_awaitable_result(value)  # packed, it would be its repr: say so instead
    except SystemExit as exc:
        if exc.code in (None, 0):
            return Outcome(ok=True, result=pack(None))
        return Outcome(ok=False, error=describe(exc, filename))
    except BaseException as exc:
        return Outcome(ok=False, error=describe(exc, filename))
    finally:
        if loop is not None:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()
        tools.report_unawaited()  # a line on the job's stderr per call never awaited
    packed, error = pack_result(value, result_limit)
    if error is not None:
        return Outcome(ok=False, error=error)
    return Outcome(ok=True, result=packed)


WARM_UP = (
    "import asyncio\n"
    "async def main():\n"
    "    await asyncio.sleep(0)\n"
    "    return {'warm': [1, 2.0, 'x', None]}\n"
)


def warm_up(result_limit: int) -> Outcome:
    """Run a throwaway job through :func:`run` while the jail waits for its own.

    A jail forked from the zygote shares its memory copy-on-write: the first touch of each
    page the code path uses is a page fault (the first ``ast.parse`` alone costs ~0.3 ms here).
    A pooled jail takes those faults now, before its job exists, instead of on the job's
    clock. The namespace is thrown away; nothing of it reaches the job.

    No throwaway tool call: a job's first call writes ~20-40 pages of the zygote's (~0.25 ms
    of CPU more than its later calls); a warm-up call over a socket pair of its own cost every
    pooled jail ~1 ms of CPU and ~140 pages more (~2.5 ms and ~175 with an awaited one), tool
    calls or not -- more than it saves, and against the pages-per-jail budget."""
    return run(WARM_UP, "<warm-up>", {"__name__": "__warm_up__"}, result_limit)
