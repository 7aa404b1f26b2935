"""A private ``jaild serve`` for one evaluation: its own socket and policy directory in a
temporary directory, stopped (SIGTERM, then SIGKILL after a grace period) and removed at the
end -- the way bench/jaildrun.py's ``PrivateDaemon`` and the tests' ``start_daemon`` run
theirs. It is ``sys.executable -m jaild`` with this checkout first on ``PYTHONPATH``: the
harness's venv holds jaild's dependencies, not jaild (``make agentdojo-venv``), so the daemon
is this checkout's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from jaild.client import Client
from jaild.errors import ConnectionLost, DaemonUnavailable

REPO = Path(__file__).resolve().parents[2]
"""The checkout the harness runs from: the daemon's jaild."""


class DaemonFailed(RuntimeError):
    """The daemon exited, or did not serve in time; the message ends with its log's tail."""


class PrivateDaemon:
    """``jaild serve`` on a private socket serving ``policies`` (name -> TOML text)."""

    def __init__(self, policies: dict[str, str], *, log_level: str = "warning",
                 log_path: Path | None = None, start_timeout_s: float = 300) -> None:
        self._policies = policies
        self._log_level = log_level
        self._start_timeout_s = start_timeout_s
        self._tmp = Path(tempfile.mkdtemp(prefix="jaild-agentdojo-"))
        os.chmod(self._tmp, 0o755)  # the jailed uid must traverse to the runtime it binds
        self.socket = str(self._tmp / "jaild.sock")
        self._log = log_path or self._tmp / "jaild.log"
        """The daemon's log (``log_path``: kept after the run; by default in the directory)."""
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrivateDaemon:
        directory = self._tmp / "policies"
        directory.mkdir()
        for name, text in self._policies.items():
            (directory / f"{name}.toml").write_text(text)
        try:
            with self._log.open("wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "jaild", "serve", "--socket", self.socket,
                     "--policies", str(directory), "--log-level", self._log_level],
                    stdout=log, stderr=subprocess.STDOUT,
                    env={**{k: v for k, v in os.environ.items() if k != "JAILD_SOCKET"},
                         "PYTHONPATH": os.pathsep.join(
                             [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])},
                )
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return "(no log)"

    def _wait_serving(self) -> None:
        """Until a client's handshake succeeds (the socket accepts connections earlier,
        during the daemon's self-tests), then check that every policy is served."""
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise DaemonFailed(f"jaild exited with {self._proc.returncode}: "
                                   f"{self.log_tail()}")
            try:  # Welcome comes once the self-tests pass: wait for it up to the deadline
                with Client(self.socket, connect_timeout_s=max(
                        1.0, deadline - time.monotonic())) as client:
                    served = {p["name"]: p for p in client.policies()}
                break
            except (DaemonUnavailable, ConnectionLost):
                if time.monotonic() > deadline:
                    raise DaemonFailed(f"jaild did not serve within {self._start_timeout_s:.0f}"
                                       f" s: {self.log_tail()}") from None
                time.sleep(0.1)
        for name in self._policies:
            entry = served.get(name)
            if entry is None or entry.get("available") is False:
                raise DaemonFailed(f"policy {name} is not served: "
                                   f"{(entry or {}).get('problems')}: {self.log_tail()}")

    def stop(self) -> None:
        """Stop the daemon (it removes its cgroups as it stops) and remove the directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)
