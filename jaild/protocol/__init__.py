"""jaild's wire protocol: framing, messages and the connection state machine (sans-IO).

Shared by the daemon, the client library and the in-jail runtime. Nothing in
this package does IO. The spec is ``proto/PROTOCOL.md``; a test keeps the two
in agreement.
"""

from jaild.protocol.connection import CLOSED, NEED_DATA, Connection, Role, State
from jaild.protocol.framing import FrameDecoder, encode_frame
from jaild.protocol.messages import MESSAGES, PROTOCOL_VERSION, decode, encode, pack, unpack

__all__ = [
    "CLOSED",
    "MESSAGES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Connection",
    "FrameDecoder",
    "Role",
    "State",
    "decode",
    "encode",
    "encode_frame",
    "pack",
    "unpack",
]
