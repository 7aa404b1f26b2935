"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes of msgpack.

The decoder checks the announced length against the link's maximum *before* it
buffers the body, so a peer cannot make us hold more than one maximum-size
frame (plus one read's worth of bytes) in memory. No IO here.
"""

from __future__ import annotations

import struct

from jaild.errors import FrameTooLarge, LocalProtocolError

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size

_COMPACT_AT = 1 << 16


def encode_frame(payload: bytes, max_frame_bytes: int) -> bytes:
    """Prefix ``payload`` with its length. Raises LocalProtocolError if it is too large to send."""
    if len(payload) > max_frame_bytes:
        raise LocalProtocolError(
            f"refusing to send a {len(payload)}-byte frame: the link allows {max_frame_bytes}"
        )
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Turns a byte stream into whole frame payloads.

    ``feed`` bytes as they arrive (any split, even byte by byte); ``next_frame``
    returns one payload or ``None`` when more bytes are needed.
    """

    __slots__ = ("_buf", "_pos", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        if self._pos >= _COMPACT_AT:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | None:
        avail = len(self._buf) - self._pos
        if avail < HEADER_BYTES:
            return None
        (length,) = HEADER.unpack_from(self._buf, self._pos)
        if length > self.max_frame_bytes:
            raise FrameTooLarge(
                f"frame announces {length} bytes; this link allows at most {self.max_frame_bytes}"
            )
        if avail < HEADER_BYTES + length:
            return None
        start = self._pos + HEADER_BYTES
        payload = bytes(self._buf[start : start + length])
        self._pos = start + length
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        return payload
