"""The daemon's dispatch table (jaild/daemon/requests.py): every request a client may send
in the protocol's ready state has a handler, and nothing else has one."""

from __future__ import annotations

from jaild.daemon.requests import HANDLERS
from jaild.protocol.connection import RECV, TRANSITIONS, Role, State

# handled by the connection itself: tool calls' replies go to the call waiting for them;
# a Pong only proves the client alive
BY_THE_CONNECTION = {"ToolReturned", "ToolFailed", "Pong"}


def test_every_request_of_the_ready_state_has_one_handler() -> None:
    received = {name for verb, name in TRANSITIONS[(Role.DAEMON, State.READY)]
                if verb == RECV}
    handled = {cls.TYPE for cls in HANDLERS}
    assert handled == received - BY_THE_CONNECTION
    assert received & BY_THE_CONNECTION == BY_THE_CONNECTION  # control: the names are real
