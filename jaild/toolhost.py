"""The client's tool host: it answers a job's tool calls with the host's functions.

A job's code calls ``tools.NAME(...)``; the daemon sends the client a ``CallTool``; the
:class:`ToolHost` of the client's connection runs the handler the job was given for that
name and returns the answer to send back (``ToolReturned``, or ``ToolFailed`` with the
exception's type and message). It also asks a job's approval callback about calls
marked ``approval``. No IO of its own: :class:`~jaild.client.AsyncClient` reads the calls
off its connection and sends what this returns.

Plain handlers (and approval callbacks) run in worker threads, ``handler_threads`` at
most at once across the client's jobs, so a slow one stalls no other job; ``async``
ones run on the client's event loop. The thread pool's module is imported with this one and
its first thread started when a job that has a plain handler is submitted
(:meth:`ToolHost.prepare`): neither is left to the job's first tool call (~2.5 ms of CPU
between them, ten times a call's own). A handler's exception is the job's to see, not the
client's: it becomes the ``ToolFailed`` answer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaild.errors import ToolCallDenied
from jaild.protocol import pack, unpack
from jaild.protocol.messages import (
    MAX_PAYLOAD_BYTES,
    ApprovalPending,
    ClientCallTool,
    ClientToolFailed,
    ClientToolReturned,
    Message,
    safe_text,
)
from jaild.toolspec import HostTool, Labeled

log = logging.getLogger("jaild.client")

TOOL_RESULT_LIMIT = MAX_PAYLOAD_BYTES
"""The most bytes a tool's packed result may take (larger: the call fails, named)."""

Approver = Callable[[str, list[Any], dict[str, Any]], Any]
"""``approve(tool, args, kwargs)`` -> True to allow the call, False or ``(False, "why")`` to
deny it (plain or async). Asked for tools marked ``approval`` (by the client or the policy)."""


def _nothing() -> None:
    """What a worker thread runs to be started."""


class ToolHost:
    """Runs one client's tool handlers and approval callbacks.

    Args:
        handler_threads: worker threads for plain handlers and callbacks (started as they
            are needed, the first by :meth:`prepare`).
    """

    def __init__(self, handler_threads: int) -> None:
        self._executor = ThreadPoolExecutor(handler_threads, thread_name_prefix="jaild-tool")
        self.prepared = False
        """Whether the first worker thread was started (by :meth:`prepare`)."""

    def prepare(self, tools: Iterable[HostTool], approve: Approver | None = None) -> None:
        """Start the first worker thread now if ``tools`` has a plain handler (or
        ``approve`` is a plain callback): called as a job is submitted, so that its first
        tool call finds the thread running, as later calls do."""
        if self.prepared:
            return
        if (approve is not None and not inspect.iscoroutinefunction(approve)) or any(
                not tool.is_async for tool in tools):
            self._executor.submit(_nothing)
            self.prepared = True

    async def _in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs)
        )

    def close(self) -> None:
        """Stop the worker threads (a handler still running finishes unheard)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def approved(self, approve: Approver | None, name: str, args: list[Any],
                       kwargs: dict[str, Any]) -> tuple[bool, str]:
        """Ask ``approve`` (plain ones run in a worker thread: they may prompt a human)
        whether the call may go on, and why. No callback: denied."""
        if approve is None:
            return False, f"{name} needs approval and this client has no approve callback"
        if inspect.iscoroutinefunction(approve):
            answer = await approve(name, args, kwargs)
        else:
            answer = await self._in_thread(approve, name, args, kwargs)
        if isinstance(answer, tuple):
            allowed, why = bool(answer[0]), str(answer[1]) if len(answer) > 1 else ""
        else:
            allowed, why = bool(answer), ""
        return allowed, why or (f"{name}: approved" if allowed else f"{name}: denied by the client")

    async def decide(self, approve: Approver | None,
                     pending: ApprovalPending) -> tuple[bool, str] | None:
        """A call held by the daemon for approval (a policy with ``[approvals]``): what the
        job's approve callback says of it; None without one (the policy's approvers then
        decide, ``jaild approve``, and the run waits)."""
        if approve is None:
            log.info("job %s: call %d (%s) waits for an approver", pending.job_id,
                     pending.call_id, pending.name)
            return None
        try:
            decoded = unpack(pending.args)
            args, kwargs = (list(decoded[0]), dict(decoded[1])) if isinstance(decoded, list) \
                else ([], {})
        except Exception:
            args, kwargs = [], {}
        try:
            return await self.approved(approve, pending.name, args, kwargs)
        except Exception as exc:
            return False, f"{pending.name}: the approve callback failed: {exc!r}"

    async def call(self, tools: Mapping[str, HostTool], approve: Approver | None,
                   call: ClientCallTool) -> Message:
        """Run the handler ``call`` names (after asking ``approve``, if the call needs
        approval) and return the answer to send: ``ToolReturned`` or ``ToolFailed``."""
        tool = tools.get(call.name)
        try:
            if tool is None:
                raise LookupError(f"no tool named {call.name!r} in this client")
            decoded = unpack(call.args)
            if not (
                isinstance(decoded, list)
                and len(decoded) == 2
                and isinstance(decoded[0], list)
                and isinstance(decoded[1], dict)
                and all(isinstance(k, str) for k in decoded[1])
            ):
                raise TypeError("malformed tool arguments from the jail")
            args, kwargs = decoded
            if call.approval:
                allowed, why = await self.approved(approve, call.name, args, kwargs)
                if not allowed:
                    raise ToolCallDenied(why)
            if tool.is_async:
                value = await tool.handler(*args, **kwargs)
            else:
                value = await self._in_thread(tool.handler, *args, **kwargs)
            labels: tuple[str, ...] = ()
            if isinstance(value, Labeled):
                value, labels = value.value, value.labels
            packed = pack(value)
            if len(packed) > TOOL_RESULT_LIMIT:
                raise ValueError(f"result of {call.name} is {len(packed)} bytes; too large to send")
            return ClientToolReturned(job_id=call.job_id, call_id=call.call_id, value=packed,
                                      labels=labels)
        except asyncio.CancelledError:
            raise
        except ToolCallDenied as exc:
            return ClientToolFailed(
                job_id=call.job_id, call_id=call.call_id, error_type="denied",
                message=safe_text(str(exc), 4096),
            )
        except Exception as exc:
            log.debug("tool %s raised", call.name, exc_info=True)
            try:
                message = str(exc)
            except Exception:
                message = "<str() of the exception failed>"
            return ClientToolFailed(
                job_id=call.job_id,
                call_id=call.call_id,
                error_type=safe_text(type(exc).__name__, 256) or "Exception",
                message=safe_text(message, 4096),
            )
