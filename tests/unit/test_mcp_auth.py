"""``jaild mcp``'s gates, without a daemon: the token file's checks, the SDK token verifier,
the Unix socket's mode and the peer's uid."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from jaild.errors import ConfigError
from jaild.mcp_server import (
    BearerToken,
    bind_unix,
    load_or_make_token,
    peer_uid,
    read_token,
    user_uid,
)

TOKEN = "a-long-enough-secret-token"


def _file(tmp_path: Path, mode: int, text: str = TOKEN + "\n") -> str:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660])
def test_a_token_file_others_may_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, mode)
    with pytest.raises(ConfigError) as info:
        read_token(path)
    assert info.value.source == path
    assert f"mode {mode:04o}" in info.value.reason and f"chmod 600 {path}" in info.value.reason
    assert read_token(_file(tmp_path, 0o600)) == TOKEN  # control: the same file, private
    assert read_token(_file(tmp_path, 0o400)) == TOKEN


def test_a_token_file_must_be_a_real_file_with_a_real_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        read_token(_file(tmp_path, 0o600, "short\n"))
    with pytest.raises(ConfigError, match="at least 16"):
        read_token(_file(tmp_path, 0o600, "two words of a long enough token\n"))
    private = _file(tmp_path, 0o600)
    os.symlink(private, tmp_path / "link")
    with pytest.raises(ConfigError, match="symlink"):
        load_or_make_token(str(tmp_path / "link"))
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token(str(tmp_path / "fifo"))  # and it does not block


def test_a_missing_token_file_is_made_private(tmp_path: Path) -> None:
    path = str(tmp_path / "new-token")
    old = os.umask(0)
    try:
        token, made = load_or_make_token(path)
    finally:
        os.umask(old)
    assert made and len(token) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_make_token(path) == (token, False)  # read back, not made again
    with pytest.raises(ConfigError, match="cannot make"):
        load_or_make_token(str(tmp_path / "no-such-dir" / "token"))


def test_the_verifier_accepts_only_the_token() -> None:
    verifier = BearerToken(TOKEN)
    assert asyncio.run(verifier.verify_token(TOKEN)) is not None
    for wrong in ("", TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
        assert asyncio.run(verifier.verify_token(wrong)) is None


def test_the_unix_socket_is_private_unless_others_are_allowed(tmp_path: Path) -> None:
    path = str(tmp_path / "mcp.sock")
    for others, mode in ((False, 0o600), (True, 0o666)):
        sock = bind_unix(path, others)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == mode
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(path)
                server_side, _ = sock.accept()
                with server_side:
                    assert peer_uid(server_side) == os.geteuid()
            with pytest.raises(ConfigError, match="already listens"):
                bind_unix(path, others)
        finally:
            sock.close()
        # a stale socket (nothing listens) is replaced on the next round
    os.unlink(path)
    Path(path).write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        bind_unix(path, False)
    assert Path(path).read_text() == "not a socket"


def test_allow_user_takes_names_and_uids() -> None:
    assert user_uid("root") == 0 and user_uid("65533") == 65533
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="no user"):
        user_uid("no-such-user-here")
