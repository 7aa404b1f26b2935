"""Daemon metrics (placeholder: being written). The daemon calls these hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Metrics:
    """What the daemon reports as it works; exported over HTTP for Prometheus when asked."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def start(self, pools: Callable[[], dict[str, dict[str, Any]]]) -> None:
        """Begin serving (if an address was given). ``pools``: policy -> pool summary."""

    def stop(self) -> None:
        """Stop serving."""

    def job_finished(self, record: dict[str, Any], uid: int) -> None:
        """A job's record, as audited."""

    def refused(self, code: str) -> None:
        """A request or connection was refused with this error code."""

    def tool_call(self, policy: str, tool: str, outcome: str, duration_s: float) -> None:
        """A tool call ended: ``outcome`` is ok, error, invalid_arguments, denied, timeout, ..."""

    def sessions_open(self, count: int) -> None:
        """How many sessions are open now."""

    def summary(self) -> dict[str, Any]:
        """For ``jaild stats``: what the metrics hold, as plain values."""
        return {}
