"""Coverage-guided fuzzing of the protocol's receive boundary. Run by hand; not part of CI.

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/atheris_protocol.py                    # until stopped or a crash
    .venv/bin/python fuzz/atheris_protocol.py -atheris_runs=200000 corpus/
    .venv/bin/python fuzz/atheris_protocol.py --write-seeds corpus/   # then fuzz with corpus/

The invariant (h11's): whatever bytes arrive, split into whatever reads, ``next_event`` returns
a message of the receiving direction, ``NEED_DATA`` or ``CLOSED``, or raises
``RemoteProtocolError``; once it has raised it raises the same error again; and the split
never changes the outcome. Anything else is a bug: the harness lets it propagate, atheris
reports the crash and saves the input.

The fast, always-run version of this check is ``tests/unit/test_protocol_fuzz.py``. This file
is not named ``test_*`` and lives outside ``tests/``, so pytest never collects it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import atheris
except ImportError:
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["jaild", "msgpack"]):
        from jaild.errors import RemoteProtocolError
        from jaild.protocol import CLOSED, MESSAGES, NEED_DATA, Connection, Role, State
        from jaild.protocol.connection import TRANSITIONS, reachable_states
        from jaild.protocol.messages import Message
else:  # --write-seeds works without atheris
    from jaild.errors import RemoteProtocolError
    from jaild.protocol import CLOSED, MESSAGES, NEED_DATA, Connection, Role, State
    from jaild.protocol.connection import TRANSITIONS, reachable_states
    from jaild.protocol.messages import Message

MAX_FRAME = 1 << 16
RECV_DIRECTION = {
    Role.CLIENT: "daemon->client",
    Role.DAEMON: "client->daemon",
    Role.SUPERVISOR: "jail->daemon",
    Role.JAIL: "daemon->jail",
}


ENDS = [(role, state) for role in Role for state in reachable_states(role)]


def drive(role: Role, state: State, reads: list[bytes], eof: bool) -> tuple[list[Message], str]:
    """Feed ``reads`` (then EOF); return the messages and how it ended. Asserts the invariant."""
    conn = Connection(role, MAX_FRAME)
    conn.state = state
    table = MESSAGES[RECV_DIRECTION[role]]  # type: ignore[index]
    got: list[Message] = []
    for data in [*reads, b""] if eof else reads:
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                try:
                    conn.next_event()
                except RemoteProtocolError as again:
                    if again is not exc:
                        raise AssertionError("a broken connection changed its error") from None
                else:
                    raise AssertionError("a broken connection produced an event") from exc
                return got, f"{type(exc).__name__}: {exc.message}"
            if event is NEED_DATA:
                if data == b"":
                    raise AssertionError("NEED_DATA after EOF")
                break
            if event is CLOSED:
                if data != b"":
                    raise AssertionError("CLOSED without EOF")
                return got, "CLOSED"
            if not isinstance(event, Message) or table.get(event.TYPE) is not type(event):
                raise AssertionError(f"not a message of this direction: {event!r}")
            got.append(event)
    return got, "NEED_DATA"


def fuzz_one_input(data: bytes) -> None:
    """Input layout: byte 0 picks the receiving end (role and state), byte 1 is flags
    (bit 0: EOF after the stream; bits 1-7: read size, 0 = one read), the rest is the stream."""
    if len(data) < 2:
        return
    role, state = ENDS[data[0] % len(ENDS)]
    eof = bool(data[1] & 1)
    size = data[1] >> 1
    stream = data[2:]
    if size:
        reads = [stream[i : i + size] for i in range(0, len(stream), size)]
    else:
        reads = [stream] if stream else []
    outcome = drive(role, state, reads, eof)
    if size:
        whole = drive(role, state, [stream] if stream else [], eof)
        if repr(outcome) != repr(whole):  # repr: NaN is a legal value and NaN != NaN
            raise AssertionError(f"the split changed the outcome: {outcome!r} != {whole!r}")


def write_seeds(directory: str) -> None:
    """One seed per sample message of the unit tests, aimed at an end that may receive it."""
    from jaild.protocol import encode, encode_frame
    from tests.unit.test_protocol import SAMPLES

    os.makedirs(directory, exist_ok=True)
    count = 0
    for direction, msgs in SAMPLES.items():
        role = next(r for r, d in RECV_DIRECTION.items() if d == direction)
        for msg in msgs:
            state = next(s for (r, s), moves in TRANSITIONS.items()
                         if r is role and ("recv", msg.TYPE) in moves)
            frame = encode_frame(encode(msg), 1 << 30)
            if len(frame) > MAX_FRAME:
                continue
            for flags in (0, 1, 7 << 1):
                name = os.path.join(directory, f"seed-{count:03d}")
                with open(name, "wb") as f:
                    f.write(bytes([ENDS.index((role, state)), flags]) + frame)
                count += 1
    print(f"wrote {count} seeds to {directory}")


def main(argv: list[str]) -> Any:
    if len(argv) == 3 and argv[1] == "--write-seeds":
        return write_seeds(argv[2])
    if atheris is None:
        sys.exit("atheris is not installed: .venv/bin/pip install atheris")
    atheris.Setup(argv, fuzz_one_input)
    atheris.Fuzz()
    return None


if __name__ == "__main__":
    main(sys.argv)
