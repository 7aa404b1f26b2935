"""Redaction: every string a job read under a redacting label, in every form a print or a dump
makes of it, replaced -- in one pass per text, or not at all (the caller withholds).

Theory of operation
-------------------
A reply carrying a label whose sink says ``redact`` gives the job's broker its *secrets*: the
reply's strings and bytes (:func:`jaild.policy.flow.strings_of`). At the run's end the result,
the output and the error are searched for them. The job can do more than echo a secret:
``print([doc])`` prints ``repr(doc)``, in which a newline is ``\\n`` and a quote may be
``\\'``; ``json.dumps(doc)`` writes ``\\"`` and, by default, ``\\uXXXX`` for every non-ASCII
character; ``return doc.encode()`` returns bytes. So each secret becomes several *patterns*
(:func:`forms`): its UTF-8 bytes, and what ``repr``/``ascii`` of it as a str and as bytes and
``json.dumps`` (``ensure_ascii`` true and false) make of it, each computed from the secret
by those functions themselves, quotes stripped -- the forms that differ.

Every pattern of every secret goes into ONE Aho-Corasick automaton (pyahocorasick, imported
here only), so a text is searched once, in time linear in its length plus the matches, for
any number of secrets (the sort per string this replaces was quadratic). Texts are searched
as bytes: a str is searched as its UTF-8 bytes, so one automaton serves str and bytes values
alike. (The automaton holds each byte as one character, the latin-1 decoding of the bytes.)
Matches are replaced leftmost-longest and without overlap: from the first byte not yet
replaced, the match that starts first, and of those the longest, by ``[redacted:LABEL]``.

A search is done in windows, each one call into the automaton, so the thread that redacts
gives up the interpreter between windows (the event loop goes on); each window starts the
longest pattern's length early and keeps only the matches that end in it, so a match across
a window's edge is found once.

Failing closed. Whatever cannot be redacted completely raises :class:`RedactionFailed`, and
the caller withholds what it was redacting: a value nested deeper than
:data:`MAX_REDACT_DEPTH`, and a :class:`Budget` run out -- more bytes scanned or matches
examined than it allows, or its deadline passed (the clock is the caller's: this module
does no IO).
"""

from __future__ import annotations

import contextlib
import heapq
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ahocorasick

from jaild.errors import RedactionFailed

MAX_REDACT_DEPTH = 64
"""A value nested deeper is not redacted: the caller withholds it."""
MAX_SCAN_BYTES = 256 << 20
"""Bytes of text one run's redaction may scan (windows' overlaps counted)."""
MAX_MATCHES = 1 << 22
"""Matches one run's redaction may examine (overlapping ones counted)."""
WINDOW_BYTES = 1 << 16
"""Bytes searched per call into the automaton (at least twice the longest pattern)."""

Secret = str | bytes


class Budget:
    """The work one run's redaction may do: bytes scanned, matches examined, a deadline.

    Args:
        scan_bytes: bytes of text it may scan.
        matches: matches it may examine.
        deadline: the time (of ``clock``) by which it must be done; None: no deadline.
        clock: the caller's clock (``time.monotonic``), read once a window.
    """

    def __init__(self, scan_bytes: int = MAX_SCAN_BYTES, matches: int = MAX_MATCHES,
                 deadline: float | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.scan_left = scan_bytes
        self.matches_left = matches
        self.deadline = deadline
        self.clock = clock
        self.scanned = 0  # the work done, for the tests that count it
        self.matched = 0

    def scan(self, n: int) -> None:
        """Spend ``n`` bytes of scanning (and check the deadline).

        Raises:
            RedactionFailed: the budget ran out.
        """
        self.scanned += n
        self.scan_left -= n
        if self.scan_left < 0:
            raise RedactionFailed("more text than redaction may scan")
        self.check_time()

    def match(self, n: int = 1) -> None:
        """Spend ``n`` matches.

        Raises:
            RedactionFailed: the budget ran out.
        """
        self.matched += n
        self.matches_left -= n
        if self.matches_left < 0:
            raise RedactionFailed("more matches than redaction may examine")

    def check_time(self) -> None:
        """Raises:
            RedactionFailed: the deadline passed."""
        if self.deadline is not None and self.clock is not None and self.clock() > self.deadline:
            raise RedactionFailed("redaction ran out of time")


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _str_forms(text: str) -> Iterable[bytes]:
    yield _utf8(text)
    yield _utf8(repr(text)[1:-1])
    yield _utf8(repr('"' + text)[2:-1])  # a str with ' and " quotes with ' and escapes it
    yield _utf8(ascii(text)[1:-1])
    yield _utf8(ascii('"' + text)[2:-1])
    yield _utf8(json.dumps(text)[1:-1])
    yield _utf8(json.dumps(text, ensure_ascii=False)[1:-1])


def _bytes_forms(data: bytes) -> Iterable[bytes]:
    yield data
    yield repr(data)[2:-1].encode("ascii")  # ascii() of bytes is repr()
    yield repr(b'"' + data)[3:-1].encode("ascii")


def forms(secret: Secret) -> list[bytes]:
    """The byte patterns of ``secret``: its plain form (UTF-8 for a str) first, then every
    escaped form that differs -- ``repr``/``ascii`` of it as a str (either quoting) and as
    UTF-8 bytes, and ``json.dumps`` of it (``ensure_ascii`` true and false). A bytes secret
    that is UTF-8 has the str forms too."""
    found: dict[bytes, None] = {}
    if isinstance(secret, str):
        found.update(dict.fromkeys(_str_forms(secret)))
        with contextlib.suppress(UnicodeEncodeError):  # a lone surrogate: no bytes of it
            found.update(dict.fromkeys(_bytes_forms(secret.encode("utf-8"))))
    else:
        found.update(dict.fromkeys(_bytes_forms(secret)))
        with contextlib.suppress(UnicodeDecodeError):  # not UTF-8: no str of it
            found.update(dict.fromkeys(_str_forms(secret.decode("utf-8"))))
    return [f for f in found if f]


class Redactor:
    """One automaton over every form of every secret (``{secret: label}``, the first label
    of a pattern two secrets share winning).

    Attributes:
        patterns: how many patterns the automaton holds.
        longest: the longest pattern's length in bytes.
    """

    def __init__(self, secrets: Mapping[str, str] | Mapping[bytes, str] | Mapping[Secret, str]
                 ) -> None:
        automaton = ahocorasick.Automaton()
        self.longest = 0
        self.patterns = 0
        for secret, label in secrets.items():
            replacement = f"[redacted:{label}]"
            for form in forms(secret):
                key = form.decode("latin-1")
                if key not in automaton:
                    automaton.add_word(key, (len(form), replacement))
                    self.patterns += 1
                    self.longest = max(self.longest, len(form))
        if self.patterns:
            automaton.make_automaton()
        self._automaton = automaton

    # -- texts

    def text(self, text: str, budget: Budget) -> str:
        """``text`` with every match replaced (see :meth:`data`).

        Raises:
            RedactionFailed: ``budget`` ran out.
        """
        if not self.patterns or not text:
            return text
        raw = _utf8(text)
        out = self.data(raw, budget)
        if out is raw:
            return text
        try:
            return out.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:  # a bytes secret cut into a character: the rest of it
            return out.decode("utf-8", "replace")

    def data(self, data: bytes, budget: Budget) -> bytes:
        """``data`` with every pattern replaced, leftmost-longest, without overlap, in one
        pass (windows of :data:`WINDOW_BYTES`); ``data`` itself if nothing matched.

        Raises:
            RedactionFailed: ``budget`` ran out.
        """
        if not self.patterns or not data:
            return data
        s = data.decode("latin-1")  # one character per byte
        n, longest = len(s), self.longest
        step = max(WINDOW_BYTES, 2 * longest)
        cursor = 0  # the first byte not yet replaced or kept
        pieces: list[str] = []
        starts: list[int] = []  # a heap of the starts of matches not yet decided
        best: dict[int, tuple[int, str]] = {}  # start -> the longest match from it

        def settle(upto: int) -> None:
            """Decide every start before ``upto``: no match still to come starts there."""
            nonlocal cursor
            while starts and starts[0] < upto:
                start = heapq.heappop(starts)
                length, replacement = best.pop(start)
                if start >= cursor:
                    pieces.append(s[cursor:start])
                    pieces.append(replacement)
                    cursor = start + length

        for low in range(0, n, step):
            high = min(n, low + step)
            begin = max(0, low - longest + 1)
            budget.scan(high - begin)
            seen = 0
            for end, (length, replacement) in self._automaton.iter(s, begin, high):
                if end < low:
                    continue  # the window before found it
                seen += 1
                if seen & 0xFFF == 0:
                    budget.match(0x1000)
                    budget.check_time()
                start = end - length + 1
                # a match ending here or later starts after end - longest: decided before
                settle(end - longest + 1)
                if start < cursor:
                    continue
                held = best.get(start)
                if held is None:
                    best[start] = (length, replacement)
                    heapq.heappush(starts, start)
                elif length > held[0]:
                    best[start] = (length, replacement)
            budget.match(seen & 0xFFF)
        settle(n)
        if not pieces:
            return data
        pieces.append(s[cursor:])
        return "".join(pieces).encode("latin-1")

    # -- values

    def value(self, value: Any, budget: Budget, depth: int = 0) -> Any:
        """An unpacked value with every str and bytes in it redacted, map keys too.

        Raises:
            RedactionFailed: nested deeper than :data:`MAX_REDACT_DEPTH`, or ``budget`` ran
                out (the caller withholds the value).
        """
        if depth > MAX_REDACT_DEPTH:
            raise RedactionFailed("too deep to redact")
        if isinstance(value, str):
            return self.text(value, budget)
        if isinstance(value, (bytes, bytearray)):
            return self.data(bytes(value), budget)
        if isinstance(value, list):
            return [self.value(v, budget, depth + 1) for v in value]
        if isinstance(value, tuple):  # a map's key, unpacked from an array
            return tuple(self.value(v, budget, depth + 1) for v in value)
        if isinstance(value, dict):
            return {self.value(k, budget, depth + 1): self.value(v, budget, depth + 1)
                    for k, v in value.items()}
        return value


__all__ = [
    "MAX_MATCHES", "MAX_REDACT_DEPTH", "MAX_SCAN_BYTES", "WINDOW_BYTES", "Budget",
    "RedactionFailed", "Redactor", "forms",
]
