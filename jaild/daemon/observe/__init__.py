"""What is seen of the daemon: Prometheus metrics (metrics), the audit log (audit), usage
totals per policy and uid (accounting)."""
