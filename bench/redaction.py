"""Section 12: what redaction costs -- 4,096 secrets (the most a job keeps) over 1 MB, as
the output of a run (one text) and as a result of many short strings; the automaton
(``jaild.policy.redact``: one pass per text) beside the sort per string it replaced (every
secret, longest first, ``str.replace`` over each string), measured in the same run.

Run alone: ``.venv/bin/python bench/redaction.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from jaild.policy.redact import Budget, Redactor

SECRETS = 4096
TEXT_BYTES = 1 << 20
SHORT_BYTES = 100


@dataclass
class RedactionCost:
    """One case: seconds per redaction, the old way and the automaton's (a median)."""

    what: str
    secrets: int
    text_bytes: int
    strings: int
    old_s: float
    new_s: float
    build_s: float  # making the automaton, once per run (included in new_s)


def _old_redact_text(text: str, secrets: Mapping[str, str]) -> str:
    """Before the automaton (jaild 0.1's ``jaild.policy.flow.redact_text``)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, f"[redacted:{secrets[secret]}]")
    return text


def _median_s(fn: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]


def _secrets(n: int, rng: random.Random) -> dict[str, str]:
    return {f"{rng.choice(['Alice', 'Bob', 'Carol'])} {i:06d}\n{rng.random():.8f}": "pii"
            for i in range(n)}


def _text(size: int, planted: list[str], rng: random.Random) -> str:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "42", "\n"]
    parts: list[str] = []
    length = 0
    while length < size:
        piece = " ".join(rng.choice(words) for _ in range(20))
        if rng.random() < 0.1:
            piece += " " + rng.choice([rng.choice(planted), json.dumps(rng.choice(planted))])
        parts.append(piece)
        length += len(piece) + 1
    return "\n".join(parts)[:size]


def measure(quick: bool = False) -> list[RedactionCost]:
    """Both cases (``quick``: a tenth of the short strings, one run each)."""
    rng = random.Random(12)
    secrets = _secrets(SECRETS, rng)
    planted = list(secrets)[:200]
    runs = 1 if quick else 3
    out = []
    text = _text(TEXT_BYTES, planted, rng)
    strings = [text[i:i + SHORT_BYTES] for i in range(0, len(text), SHORT_BYTES)]
    if quick:
        strings = strings[: len(strings) // 10]
    build_s = _median_s(lambda: Redactor(secrets), runs)

    def new_output() -> object:
        return Redactor(secrets).text(text, Budget())

    def new_result() -> object:
        redactor = Redactor(secrets)
        return redactor.value(strings, Budget())

    out.append(RedactionCost(
        "output: one text", SECRETS, len(text), 1,
        _median_s(lambda: _old_redact_text(text, secrets), runs),
        _median_s(new_output, runs), build_s))
    out.append(RedactionCost(
        f"result: {len(strings):,} strings of {SHORT_BYTES} B", SECRETS,
        sum(len(s) for s in strings), len(strings),
        _median_s(lambda: [_old_redact_text(s, secrets) for s in strings], runs),
        _median_s(new_result, runs), build_s))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer strings, one run each")
    args = p.parse_args(argv)
    for row in measure(args.quick):
        print(f"{row.what}: {row.secrets} secrets over {row.text_bytes:,} B: "
              f"sort per string {row.old_s:.3f} s, automaton {row.new_s:.3f} s "
              f"(of which building it {row.build_s:.3f} s): "
              f"{row.old_s / row.new_s:,.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
