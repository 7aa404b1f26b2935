"""Fresh random state for every forked jail.

Theory of operation
-------------------
A zygote imports its policy's ``preimport`` modules once, and every jail it forks
starts with a copy of its memory -- including the state of every pseudo-random
generator those modules hold. Without help, two jobs (possibly of two users) would
draw the same "random" numbers, and one could predict the other's.

The zygote calls :func:`survey` once, after its imports and before its first fork:
it walks the globals of every module in ``sys.modules`` (~6 ms with numpy and
pandas, far too slow to repeat per jail) and keeps the generator objects it finds.
Each forked jail calls :func:`reseed` with that list before any user code runs; it
reseeds each object from fresh kernel entropy (``os.urandom``, i.e. ``getrandom``),
at a cost of microseconds.

Covered -- process-global generator objects reachable from a module's globals:

* :class:`random.Random` instances (``random._inst``, which CPython also reseeds at
  ``os.fork``, and any a library keeps at module level); ``SystemRandom`` has no
  state and is skipped;
* numpy's legacy ``RandomState`` objects -- ``numpy.random.mtrand._rand``, behind
  ``numpy.random.rand``/``seed``/..., and so pandas' ``sample()`` and every other
  user of ``random_state=None``;
* numpy ``Generator`` objects kept at module level (their bit generator's state is
  replaced by one seeded from fresh entropy). ``numpy.random.default_rng()`` keeps no
  global state: each call draws fresh OS entropy, so it needs nothing.

Not covered: state held elsewhere than a module's globals (an attribute of a class
or of some other object, a closure), and a library's private C-level generator
(a C static seeded once at import; numpy's and CPython's are not of that kind).
Such a library keeps cloned state across forked jails; a policy that pre-imports one
and needs fresh state in every job should use ``pool.mode = "spawn"``. What no fork
can renew -- the address-space layout, the stack canary and pointer guard,
``AT_RANDOM`` and the ``str`` hash seed -- is shared by the jails of one zygote;
the daemon gives each client uid zygotes of its own (docs/security.md).

Pure but for the entropy it reads; it imports nothing that was not imported already.
"""

from __future__ import annotations

import _random
import os
import random
import sys
from collections.abc import Iterable
from typing import Any

SEED_BYTES = 32


def _numpy_kinds() -> tuple[type[Any], ...]:
    """numpy's generator classes, if numpy.random is already imported (never imports it)."""
    module = sys.modules.get("numpy.random")
    if module is None:
        return ()
    return tuple(
        kind
        for kind in (getattr(module, "RandomState", None), getattr(module, "Generator", None))
        if isinstance(kind, type)
    )


def survey(modules: Iterable[Any] | None = None) -> list[object]:
    """The process-global generator objects in the globals of ``modules`` (by default every
    module imported now), each once. Run it once, in the zygote, before forking."""
    kinds: tuple[type[Any], ...] = (random.Random, *_numpy_kinds())
    found: dict[int, object] = {}
    for module in list(sys.modules.values()) if modules is None else modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            if isinstance(value, kinds) and not isinstance(value, random.SystemRandom):
                found.setdefault(id(value), value)
    return list(found.values())


def _reseed_one(generator: object) -> None:
    entropy = os.urandom(SEED_BYTES)
    if type(generator) is random.Random:
        # The C seed itself, from the entropy as an int, and what ``Random.seed`` resets
        # besides: its Python half (a sha512 of bytes, the call through) writes ~25 pages a
        # forked jail would copy from its zygote.
        _random.Random.seed(generator, int.from_bytes(entropy, "little"))
        generator.gauss_next = None  # type: ignore[attr-defined]
        return
    if isinstance(generator, random.Random):  # a subclass: its own seed()
        generator.seed(entropy)
        return
    kind = type(generator).__name__
    if kind == "RandomState":
        words = [int.from_bytes(entropy[i : i + 4], "little") for i in range(0, SEED_BYTES, 4)]
        generator.seed(words)  # type: ignore[attr-defined]
    elif kind == "Generator":
        bits = generator.bit_generator  # type: ignore[attr-defined]
        bits.state = type(bits)(int.from_bytes(entropy, "little")).state


def reseed(generators: Iterable[object]) -> int:
    """Reseed each of ``generators`` (from :func:`survey`) from fresh kernel entropy; in a
    forked jail, before any user code. Returns how many were reseeded.

    Raises:
        OSError: no entropy could be read (the jail must not run code then).
    """
    count = 0
    for generator in generators:
        _reseed_one(generator)
        count += 1
    return count


__all__ = ["reseed", "survey"]
