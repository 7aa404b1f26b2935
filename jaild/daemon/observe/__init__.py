"""What is seen of the daemon: Prometheus metrics (metrics), the audit log (audit), usage
totals per policy and uid (accounting), and the traces (:mod:`jaild.tracing`), together
as :class:`Observers`."""

from __future__ import annotations

from dataclasses import dataclass

from jaild.daemon.observe.accounting import Accounting
from jaild.daemon.observe.audit import AuditLog
from jaild.daemon.observe.metrics import Metrics
from jaild.tracing import Tracing


@dataclass
class Observers:
    """Where what the daemon does is told: the audit trail, the accounting per uid, the
    metrics and the traces. One object for the daemon's life, handed to the pipeline and
    the sessions when they are made; its members are replaced as the daemon starts (the
    audit file once the config is read, tracing as ``OTEL_*`` asks) and stops (tracing off),
    so they always read them from here."""

    audit: AuditLog
    accounting: Accounting
    metrics: Metrics
    tracing: Tracing


__all__ = ["Observers"]
