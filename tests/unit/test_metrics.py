"""Metrics: hooks -> Prometheus exposition, label bounds, the stats summary, the endpoint."""

from __future__ import annotations

import asyncio
import gzip
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaild.daemon.observe.metrics import (
    MAX_OUTCOMES_PER_POLICY,
    MAX_TOOLS_PER_POLICY,
    TOOL_CALL_BATCH,
    Metrics,
    MetricsAddressError,
    _quantile,
    parse_address,
)
from jaild.protocol.records import JobError, JobRecord, Usage


def record(policy: str = "default", status: str = "ok", duration_s: float = 0.02,
           wall_s: float = 0.01, user: float | None = 0.004, system: float | None = 0.001,
           ran: bool = True) -> JobRecord:
    usage = Usage(wall_s=wall_s, cpu_user_s=user, cpu_system_s=system, memory_peak_bytes=None,
                  pids_peak=None, output_bytes=0, tool_calls=0, tool_time_s=0.0,
                  stream_paused_s=0.0, stream_dropped_bytes=0)
    return JobRecord(
        job_id="job-0000000000000001", policy=policy, status=status, stdout="", stderr="",
        error=None if status == "ok" else JobError(type="Error", message=""), tool_calls=(),
        duration_s=duration_s, limits={}, usage=usage if ran else None, files=(),
        files_skipped=(), tool_calls_omitted=0, session=None,
    )


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition text, parsed back: (name, labels) -> value."""
    text = generate_latest(m.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_jobs_by_policy_and_status_latency_and_cpu() -> None:
    m = Metrics()
    m.job_finished(record(), 0)
    m.job_finished(record(status="error", duration_s=0.3, wall_s=0.2), 1000)
    m.job_finished(record(policy="data", status="timeout", duration_s=5.5, wall_s=5.0,
                          user=4.5, system=0.5), 0)
    assert value(m, "jaild_jobs_total", policy="default", status="ok") == 1
    assert value(m, "jaild_jobs_total", policy="default", status="error") == 1
    assert value(m, "jaild_jobs_total", policy="data", status="timeout") == 1
    assert value(m, "jaild_job_duration_seconds_count", policy="default") == 2
    assert value(m, "jaild_job_duration_seconds_sum", policy="default") == pytest.approx(0.32)
    assert value(m, "jaild_job_wall_seconds_sum", policy="data") == pytest.approx(5.0)
    # buckets span 1 ms .. 60 s
    assert value(m, "jaild_job_duration_seconds_bucket", policy="default", le="0.001") == 0
    assert value(m, "jaild_job_duration_seconds_bucket", policy="default", le="0.025") == 1
    assert value(m, "jaild_job_duration_seconds_bucket", policy="default", le="0.5") == 2
    assert value(m, "jaild_job_duration_seconds_bucket", policy="data", le="60.0") == 1
    assert value(m, "jaild_job_cpu_seconds_total", policy="data", mode="user") == 4.5
    assert value(m, "jaild_job_cpu_seconds_total", policy="data", mode="system") == 0.5
    # uids are never labels
    assert not any("uid" in dict(labels) for _, labels in samples(m))


def test_a_job_whose_code_never_ran_counts_but_has_no_wall_time() -> None:
    m = Metrics()
    m.job_finished(record(status="error", duration_s=0.0, ran=False), 0)
    m.job_finished(record(status="internal_error", duration_s=0.0, ran=False), 0)
    assert value(m, "jaild_jobs_total", policy="default", status="error") == 1
    assert value(m, "jaild_jobs_total", policy="default", status="internal_error") == 1
    assert value(m, "jaild_job_duration_seconds_count", policy="default") == 2
    assert value(m, "jaild_job_wall_seconds_count", policy="default") is None
    assert value(m, "jaild_job_cpu_seconds_total", policy="default", mode="user") is None


def test_refused_sessions_build_and_start_time() -> None:
    m = Metrics()
    m.refused("unknown_policy")
    m.refused("unknown_policy")
    m.refused("busy")
    m.sessions_open(3)
    m.sessions_open(2)
    assert value(m, "jaild_refused_requests_total", code="unknown_policy") == 2
    assert value(m, "jaild_refused_requests_total", code="busy") == 1
    assert value(m, "jaild_sessions_open") == 2
    assert (value(m, "jaild_start_time_seconds") or 0) > 1.6e9
    build = [labels for name, labels in samples(m) if name == "jaild_build_info"]
    assert len(build) == 1 and dict(build[0])["version"]
    assert value(m, "process_open_fds") is not None  # the daemon process's own


def test_tool_calls_by_policy_tool_and_outcome() -> None:
    m = Metrics(tool_labels=True)
    m.tool_call("default", "fetch", "ok", 0.004)
    m.tool_call("default", "fetch", "ok", 0.006)
    m.tool_call("default", "fetch", "timeout", 2.0)
    m.tool_call("data", "query", "denied", 0.0)
    assert value(m, "jaild_tool_calls_total", policy="default", tool="fetch", outcome="ok") == 2
    assert value(m, "jaild_tool_calls_total", policy="default", tool="fetch",
                 outcome="timeout") == 1
    assert value(m, "jaild_tool_calls_total", policy="data", tool="query", outcome="denied") == 1
    assert value(m, "jaild_tool_call_duration_seconds_count", policy="default", tool="fetch") == 3
    assert value(m, "jaild_tool_call_duration_seconds_bucket", policy="default", tool="fetch",
                 le="0.005") == 1


def test_tool_names_and_outcomes_are_bounded_per_policy() -> None:
    m = Metrics(tool_labels=True)
    for i in range(MAX_TOOLS_PER_POLICY + 10):
        m.tool_call("default", f"tool{i}", "ok", 0.001)
    m.tool_call("default", "tool0", "ok", 0.001)  # an early name keeps its label
    m.tool_call("other-policy", "fresh", "ok", 0.001)  # each policy has its own slots
    # names the jailed code made up (the client offers no such tool) take no slot at all
    for i in range(100):
        m.tool_call("default", f"made_up_{i}", "unknown_tool", 0.0)
    for i in range(MAX_OUTCOMES_PER_POLICY + 5):
        m.tool_call("default", "tool0", f"HandlerError{i}", 0.001)
    s = samples(m)
    tools = {dict(lb)["tool"] for name, lb in s if name == "jaild_tool_calls_total"
             and dict(lb)["policy"] == "default"}
    assert tools == {f"tool{i}" for i in range(MAX_TOOLS_PER_POLICY)} | {"(other)", "(unknown)"}
    assert value(m, "jaild_tool_calls_total", policy="default", tool="(other)", outcome="ok") == 10
    assert value(m, "jaild_tool_calls_total", policy="default", tool="tool0", outcome="ok") == 2
    assert value(m, "jaild_tool_calls_total", policy="default", tool="(unknown)",
                 outcome="unknown_tool") == 100
    assert value(m, "jaild_tool_calls_total", policy="other-policy", tool="fresh",
                 outcome="ok") == 1
    outcomes = {dict(lb)["outcome"] for name, lb in s if name == "jaild_tool_calls_total"
                and dict(lb)["policy"] == "default"}
    assert len(outcomes) == MAX_OUTCOMES_PER_POLICY + 1 and "(other)" in outcomes
    # and one very long name is cut
    m.tool_call("third", "x" * 1000, "ok", 0.0)
    assert value(m, "jaild_tool_calls_total", policy="third", tool="x" * 64, outcome="ok") == 1


def test_noted_tool_calls_are_counted_in_batches_and_before_every_read() -> None:
    """A call is only noted on its round trip; the series catch up every TOOL_CALL_BATCH
    calls, and whoever reads the registry (a scrape) or the summary sees every call noted."""
    m = Metrics(tool_labels=True)
    for _ in range(TOOL_CALL_BATCH - 1):
        m.tool_call("default", "fetch", "ok", 0.001)
    assert len(m._pending_calls) == TOOL_CALL_BATCH - 1  # not yet counted
    m.tool_call("default", "fetch", "ok", 0.001)
    assert m._pending_calls == []  # the batch is full: counted
    m.tool_call("default", "fetch", "ok", 0.001)
    text = generate_latest(m.registry).decode()  # a scrape reads the noted call too
    assert f'jaild_tool_calls_total{{outcome="ok",policy="default",tool="fetch"}} ' \
        f"{float(TOOL_CALL_BATCH + 1)}" in text
    m.tool_call("default", "fetch", "timeout", 2.0)
    assert m.summary()["tool_calls"]["default"]["fetch"] == {"ok": TOOL_CALL_BATCH + 1,
                                                               "timeout": 1}
    # names the jail made up share one cached series: memory stays bounded
    for i in range(3 * TOOL_CALL_BATCH):
        m.tool_call("default", f"made_up_{i}", "unknown_tool", 0.0)
    assert value(m, "jaild_tool_calls_total", policy="default", tool="(unknown)",
                 outcome="unknown_tool") == 3 * TOOL_CALL_BATCH
    assert len(m._series) == 3


def test_tool_names_are_not_exposed_by_default() -> None:
    """By default the exposition has tool calls per policy and outcome only; the per-tool
    counts stay in the summary (root's ``jaild stats``). Control: with tool labels on, the
    same calls expose the name."""
    for tool_labels in (False, True):
        m = Metrics(tool_labels=tool_labels)
        m.tool_call("default", "secret_tool_name", "ok", 0.004)
        m.tool_call("default", "secret_tool_name", "denied", 0.0)
        text = generate_latest(m.registry).decode()
        assert ("secret_tool_name" in text) is tool_labels, text
        assert m.summary()["tool_calls"] == {"default": {"secret_tool_name": {"denied": 1,
                                                                              "ok": 1}}}
        if not tool_labels:
            assert value(m, "jaild_tool_calls_total", policy="default", outcome="ok") == 1
            assert value(m, "jaild_tool_call_duration_seconds_count", policy="default") == 2


def test_pools_are_read_at_collection() -> None:
    m = Metrics()
    pools: dict[str, dict[str, Any]] = {"default": {"ready": 1, "target": 4, "hits": 7}}
    m.start(lambda: pools)  # no address: nothing served, but pools are read
    assert value(m, "jaild_pool_ready_jails", policy="default") == 1
    pools["default"] = {"ready": 3, "target": 4, "hits": 9, "misses": 2}
    assert value(m, "jaild_pool_ready_jails", policy="default") == 3
    assert value(m, "jaild_pool_target_jails", policy="default") == 4
    assert value(m, "jaild_pool_hits_total", policy="default") == 9
    assert value(m, "jaild_pool_misses_total", policy="default") == 2
    assert m.summary()["pools"] == {"default": {"ready": 3, "target": 4}}
    m.stop()
    assert m.summary()["pools"] == {}


def test_a_failing_pools_reader_does_not_fail_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()

    def broken() -> dict[str, dict[str, Any]]:
        raise RuntimeError("boom")

    m.start(broken)
    m.refused("busy")
    assert value(m, "jaild_refused_requests_total", code="busy") == 1
    assert "reading the pool summaries failed" in caplog.text


def test_summary_holds_plain_values() -> None:
    m = Metrics()
    for ms in (2, 3, 4, 8, 40):  # p50 lands in the 2.5..5 ms bucket, p95 in 25..50 ms
        m.job_finished(record(duration_s=ms / 1000, wall_s=ms / 2000), 0)
    m.job_finished(record(status="error"), 0)
    m.tool_call("default", "fetch", "ok", 0.003)
    m.tool_call("default", "fetch", "KeyError", 0.003)
    m.refused("unknown_policy")
    m.sessions_open(1)
    s = m.summary()
    assert s["jobs"] == {"default": {"error": 1, "ok": 5}}
    total = s["latency"]["default"]["duration_s"]
    assert total["count"] == 6 and total["sum_s"] == pytest.approx(0.077)
    assert 0.0025 <= total["p50_s"] <= 0.005
    assert 0.025 <= total["p95_s"] <= 0.05
    assert s["latency"]["default"]["wall_s"]["count"] == 6
    assert s["cpu_s"]["default"]["user"] == pytest.approx(0.024)
    assert s["tool_calls"] == {"default": {"fetch": {"KeyError": 1, "ok": 1}}}
    assert s["tool_latency"]["default"]["fetch"]["count"] == 2
    assert s["refused"] == {"unknown_policy": 1}
    assert s["sessions_open"] == 1
    assert s["endpoint"] is None
    assert Metrics().summary()["latency"] == {}


def test_jaild_stats_shows_a_tools_latency_on_its_own_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The latency histogram is per tool, over every outcome: ``jaild stats`` prints it once,
    on the tool's row with the count it covers, never beside one outcome (it once stood on
    the first outcome's row, so a refused call looked 40 ms slow)."""
    from jaild.cli import _print_metrics

    m = Metrics()
    m.tool_call("default", "fetch", "quota", 0.0)
    for _ in range(3):
        m.tool_call("default", "fetch", "ok", 0.040)
    m.tool_call("default", "other", "ok", 0.003)
    _print_metrics(m.summary())
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("default ")]
    assert [row[:3] for row in rows] == [["default", "fetch", "4"], ["default", "other", "1"]]
    fetch, other = rows
    assert fetch[7:] == ["ok", "3,", "quota", "1"]  # every outcome, the latency once
    assert other[7:] == ["ok", "1"]
    assert fetch[3:7] != other[3:7]  # each tool its own latency


def test_quantile_estimates_like_prometheus() -> None:
    inf = float("inf")
    assert _quantile(0.5, [(1.0, 0), (inf, 0)]) is None
    assert _quantile(0.5, [(1.0, 2), (2.0, 4), (inf, 4)]) == 1.0
    assert _quantile(0.75, [(1.0, 2), (2.0, 4), (inf, 4)]) == 1.5
    assert _quantile(0.99, [(1.0, 1), (inf, 10)]) == 1.0  # above the last finite bucket


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("localhost:1", ("localhost", 1)),
    ("[::1]:9464", ("::1", 9464)),
    (" 0.0.0.0:65535 ", ("0.0.0.0", 65535)),
])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", [
    "9464", ":9464", "127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "::1:9464", "[::1]9464",
    "127.0.0.1:70000", "127.0.0.1:-1",
])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(MetricsAddressError, match=r"daemon\.metrics_address"):
        parse_address(text)


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_endpoint_serves_metrics_over_http_and_stop_closes_it() -> None:
    port = free_port()

    async def main() -> None:
        m = Metrics(f"127.0.0.1:{port}")
        m.start(lambda: {"default": {"ready": 2, "target": 2}})
        assert m.listening == ("127.0.0.1", port)
        m.refused("busy")
        url = f"http://127.0.0.1:{port}"
        get = asyncio.get_running_loop().run_in_executor
        status, headers, body = await get(None, fetch, url + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert 'jaild_refused_requests_total{code="busy"} 1.0' in body.decode()
        assert 'jaild_pool_ready_jails{policy="default"} 2.0' in body.decode()
        status, headers, body = await get(
            None, fetch, url + "/metrics", {"Accept-Encoding": "gzip"}
        )
        assert headers["Content-Encoding"] == "gzip"
        assert b"jaild_sessions_open" in gzip.decompress(body)
        status, headers, body = await get(
            None, fetch, url + "/metrics", {"Accept": "application/openmetrics-text"}
        )
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")
        assert (await get(None, fetch, url + "/"))[0] == 404
        assert m.summary()["endpoint"] == f"http://127.0.0.1:{port}/metrics"
        m.stop()
        assert m.listening is None
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

    asyncio.run(main())


def test_a_slow_or_garbage_client_does_not_hold_the_endpoint() -> None:
    port = free_port()

    async def main() -> None:
        m = Metrics(f"127.0.0.1:{port}")
        m.start(dict)
        loop = asyncio.get_running_loop()
        # a connection that never sends its request, one that sends garbage, one too large
        idle = socket.create_connection(("127.0.0.1", port))
        for request in (b"NONSENSE\r\n\r\n", b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20000):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.setblocking(False)
                await loop.sock_sendall(s, request)
                answer = await asyncio.wait_for(loop.sock_recv(s, 100), 5)
                assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), answer
        status, _, _ = await loop.run_in_executor(
            None, fetch, f"http://127.0.0.1:{port}/metrics"
        )
        assert status == 200
        m.stop()
        await m.wait_closed()  # the cancelled connection closes
        assert asyncio.all_tasks() == {asyncio.current_task()}  # none left behind
        idle.settimeout(5)
        assert idle.recv(10) == b""
        idle.close()

    asyncio.run(main())


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]

        async def main() -> None:
            m = Metrics(f"127.0.0.1:{port}")
            with pytest.raises(MetricsAddressError, match=f"port {port} on 127.0.0.1 is already "
                                                          "in use"):
                m.start(dict)
            assert m.listening is None
            m.stop()

        asyncio.run(main())


def test_an_address_not_of_this_host_is_a_clear_error() -> None:
    async def main() -> None:
        with pytest.raises(MetricsAddressError, match="no interface of this host"):
            Metrics("192.0.2.1:9464").start(dict)  # TEST-NET-1: never local
        with pytest.raises(MetricsAddressError, match="cannot resolve host"):
            Metrics("no-such-host.invalid:9464").start(dict)

    asyncio.run(main())


def test_no_address_listens_nowhere() -> None:
    m = Metrics()
    m.start(dict)  # no event loop needed either
    assert m.listening is None and m.summary()["endpoint"] is None
    m.stop()


def test_egress_requests_and_bytes_by_policy_and_outcome() -> None:
    m = Metrics()
    m.egress("web", {"policy": "web", "method": "GET", "status": 200, "bytes_out": 100,
                     "bytes_in": 900})
    m.egress("web", {"policy": "web", "status": 403, "refused": "not_allowed", "bytes_out": 0,
                     "bytes_in": 0})
    m.egress("web", {"policy": "web", "error": "connection lost", "bytes_out": 5,
                     "bytes_in": 0})
    assert value(m, "jaild_egress_requests_total", policy="web", outcome="ok") == 1
    assert value(m, "jaild_egress_requests_total", policy="web", outcome="not_allowed") == 1
    assert value(m, "jaild_egress_requests_total", policy="web", outcome="error") == 1
    assert value(m, "jaild_egress_bytes_total", policy="web", direction="out") == 105
    assert value(m, "jaild_egress_bytes_total", policy="web", direction="in") == 900
