"""The blocking facade of the asyncio clients: one loop thread, methods declared once.

:class:`~jaild.client.Client` and :class:`~jaild.fleet.Fleet` (and their jobs and
sessions) are the asyncio classes without ``await``. Both are built from the two pieces
here, so that neither repeats the other nor the asyncio class it wraps:

* :class:`Portal`: a private event loop on a thread of its own, which runs coroutines for
  callers on other threads: in the caller's trace context (a job sent from a traced
  thread joins its trace), and a ``KeyboardInterrupt`` while waiting cancels what it
  waited for.
* :func:`blocking` and :func:`wrapping`: a blocking class's method declared from the
  asyncio class's, ``run = blocking(AsyncClient.run)``: the signature (mypy and
  ``inspect`` see the asyncio method's parameters), the docstring (``help()``,
  mkdocstrings) and the behaviour (it calls the method of that name on the wrapped
  object, through the portal) come from it; ``wrap`` turns what it returns (an
  ``AsyncJob``) into the blocking kind (a ``Job``).

A blocking class is a :class:`Facade`: it names the asyncio object it wraps
(``_async``) and the portal it runs on (``_portal``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from jaild import loops, tracing

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")


class Portal:
    """A private event loop running on its own (daemon) thread, started at once.

    Args:
        event_loop: the loop's kind: "asyncio", "uvloop" or "auto" (:mod:`jaild.loops`).
        name: the thread's name.
    """

    def __init__(self, event_loop: str = loops.DEFAULT, name: str = "jaild-client") -> None:
        self.loop = loops.new_event_loop(event_loop)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the portal's loop and wait for it -- in the caller's trace
        context, if it has one. A ``KeyboardInterrupt`` while waiting cancels it."""
        context = tracing.caller_context()
        if context is not None:
            coro = tracing.within(context, coro)
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise

    def wait(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the portal's loop and wait ``timeout`` seconds at most for it:
        past that, ``TimeoutError``, and ``coro`` goes on (a job keeps running)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop, join its thread and close the loop. Idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Facade(Protocol):
    """A blocking class: the asyncio object it wraps and the portal it runs on."""

    @property
    def _async(self) -> Any: ...

    @property
    def _portal(self) -> Portal: ...


def _declared(method: Callable[..., Any], call: Callable[..., Any], returns: object,
              renames: Mapping[str, str] | None) -> Callable[..., Any]:
    """``call`` dressed as ``method``: its name, signature and docstring, the docstring's
    words in ``renames`` replaced (``AsyncJob`` -> ``Job``; the class in ``__qualname__``
    too: ``Client.run``), and ``returns`` as its return annotation if given.
    ``__wrapped__`` is ``method``: ``typing.get_type_hints`` reads the annotations in
    ``method``'s module."""
    functools.update_wrapper(call, method)
    owner, _, rest = method.__qualname__.partition(".")
    call.__qualname__ = f"{(renames or {}).get(owner, owner)}.{rest}"  # Client.run
    try:
        signature = inspect.signature(method, eval_str=True)  # as the method's own reads
    except NameError:  # an annotation only the type checker can resolve
        signature = inspect.signature(method)
    call.__annotations__ = dict(method.__annotations__)  # not shared with ``method``
    if returns is not inspect.Signature.empty:
        signature = signature.replace(return_annotation=returns)
        call.__annotations__["return"] = returns
    call.__signature__ = signature  # type: ignore[attr-defined]
    doc = method.__doc__ or ""
    for word, blocking_word in (renames or {}).items():
        doc = doc.replace(word, blocking_word)
    call.__doc__ = doc
    return call


@overload
def blocking(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], *, returns: object = ...,
    renames: Mapping[str, str] | None = ...,
) -> Callable[Concatenate[Any, P], R]: ...
@overload
def blocking(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], *,
    wrap: Callable[[Any, R], W], returns: object = ..., renames: Mapping[str, str] | None = ...,
) -> Callable[Concatenate[Any, P], W]: ...
def blocking(method: Callable[..., Any], *, wrap: Callable[[Any, Any], Any] | None = None,
             returns: object = inspect.Signature.empty,
             renames: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """A blocking method of a :class:`Facade`, declared from the asyncio class's coroutine
    method: it calls the wrapped object's method of that name through the portal and
    returns what it returns (through ``wrap(facade, value)``, if given).

    Args:
        method: the asyncio class's method (``AsyncClient.run``).
        wrap: turns the asyncio result into the blocking kind (``Job``).
        returns: the return annotation ``help()`` shows (default: ``method``'s).
        renames: words of ``method``'s docstring to say otherwise for the blocking
            class (``{"AsyncJob": "Job", "await ": ""}``).
    """
    name = method.__name__

    def call(self: Facade, /, *args: Any, **kwargs: Any) -> Any:
        value = self._portal.call(getattr(self._async, name)(*args, **kwargs))
        return value if wrap is None else wrap(self, value)

    return _declared(method, call, returns, renames)


def wrapping(method: Callable[Concatenate[Any, P], R], wrap: Callable[[Any, R], W], *,
             returns: object = inspect.Signature.empty,
             renames: Mapping[str, str] | None = None) -> Callable[Concatenate[Any, P], W]:
    """A method of a :class:`Facade` declared from the asyncio class's plain method that
    makes an object of the asyncio kind (``AsyncClient.session``): it calls the wrapped
    object's method of that name (no portal: nothing is sent) and returns
    ``wrap(facade, value)``."""
    name = method.__name__

    def call(self: Facade, /, *args: Any, **kwargs: Any) -> Any:
        return wrap(self, getattr(self._async, name)(*args, **kwargs))

    return _declared(method, call, returns, renames)
