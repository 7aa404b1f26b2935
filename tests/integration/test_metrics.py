"""The Prometheus endpoint of a real daemon, scraped over real HTTP, and ``jaild stats``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaild.client import Client
from jaild.errors import UnknownPolicy
from tests.conftest import (
    REPO_POLICIES,
    DaemonHandle,
    guard,
    policy_texts,
    start_daemon,
    sweep_cgroups,
)
from tests.integration.test_faults import write_config

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def samples(self) -> Samples:
        with urllib.request.urlopen(self.url, timeout=guard(10)) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples().get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def md(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonHandle, Scraper]]:
    directory = tmp_path_factory.mktemp("metrics")
    port = free_port()
    config = write_config(directory, f'[daemon]\nmetrics_address = "127.0.0.1:{port}"\n')
    handle = start_daemon(directory, policy_texts("default"), with_repo_policies=False,
                          args=("--config", config))
    yield handle, Scraper(port)
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)
    with pytest.raises(ConnectionRefusedError):  # a stopped daemon's port is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def jaild_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JAILD_SOCKET"}
    return subprocess.run([sys.executable, "-m", "jaild", *args], capture_output=True, text=True,
                          timeout=guard(60), env=env, check=False)


def test_jobs_refusals_and_sessions_are_scraped(md: tuple[DaemonHandle, Scraper]) -> None:
    d, scrape = md
    before = scrape.samples()

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return scrape.samples().get(key, 0.0) - before.get(key, 0.0)

    with Client(d.socket) as c:
        # 0.1 s of the job's own CPU time in user mode: trivial code alone can stay under the
        # accounting's 10 ms tick, and the sum below would be 0
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.1: pass\n6 * 7"
        assert c.run(burn).status == "ok"
        assert c.run("import time\ntime.sleep(0.3)\nraise ValueError('no')").status == "error"
        assert c.run("import time\ntime.sleep(30)", timeout=1).status == "timeout"
        with pytest.raises(UnknownPolicy):
            c.run("1", policy="no-such-policy")
        with c.session() as s:
            assert s.run("1 + 1").status == "ok"
            assert scrape.value("jaild_sessions_open") == 1
        assert scrape.value("jaild_sessions_open") == 0

    assert delta("jaild_jobs_total", policy="default", status="ok") == 2  # the session's run too
    assert delta("jaild_jobs_total", policy="default", status="error") == 1
    assert delta("jaild_jobs_total", policy="default", status="timeout") == 1
    assert delta("jaild_refused_requests_total", code="unknown_policy") == 1
    assert delta("jaild_job_duration_seconds_count", policy="default") == 4
    assert delta("jaild_job_wall_seconds_count", policy="default") == 4
    # the timed-out job's 1 s is in the histogram's sum, and in no bucket below 1 s
    assert delta("jaild_job_wall_seconds_sum", policy="default") >= 1.3
    assert delta("jaild_job_wall_seconds_bucket", policy="default", le="0.5") <= 3
    assert delta("jaild_job_wall_seconds_bucket", policy="default", le="60.0") == 4
    assert delta("jaild_job_cpu_seconds_total", policy="default", mode="user") > 0
    now = scrape.samples()
    assert now[("jaild_pool_target_jails", frozenset({("policy", "default")}))] >= 0
    assert ("jaild_pool_ready_jails", frozenset({("policy", "default")})) in now
    started = now[("jaild_start_time_seconds", frozenset())]
    assert time.time() - 600 < started <= time.time()
    assert any(name == "jaild_build_info" for name, _ in now)
    assert now[("process_open_fds", frozenset())] > 0


def test_the_endpoint_answers_only_metrics(md: tuple[DaemonHandle, Scraper]) -> None:
    _, scrape = md
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(scrape.url.replace("/metrics", "/"), timeout=guard(10))
    assert info.value.code == 404
    info.value.close()
    request = urllib.request.Request(scrape.url, data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=guard(10))
    assert info.value.code == 405
    info.value.close()


def test_jaild_stats_shows_the_metrics(md: tuple[DaemonHandle, Scraper]) -> None:
    d, scrape = md
    with Client(d.socket) as c:
        assert c.run("1").status == "ok"
        with pytest.raises(UnknownPolicy):
            c.run("1", policy="no-such-policy")
    out = jaild_cli("stats", "--socket", d.socket, "--json")
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout)["metrics"]
    assert metrics["jobs"]["default"]["ok"] >= 1
    assert metrics["refused"]["unknown_policy"] >= 1
    latency = metrics["latency"]["default"]["duration_s"]
    assert latency["count"] >= 1 and latency["p50_s"] > 0 and latency["p95_s"] >= latency["p50_s"]
    assert metrics["endpoint"] == scrape.url
    assert "default" in metrics["pools"] and metrics["sessions_open"] == 0
    # the JSON summary and the scrape agree
    assert metrics["jobs"]["default"]["ok"] == scrape.value(
        "jaild_jobs_total", policy="default", status="ok"
    )
    text = jaild_cli("stats", "--socket", d.socket)
    assert text.returncode == 0, text.stderr
    assert "LATENCY" in text.stdout and "P95 TOTAL" in text.stdout
    assert "refused: " in text.stdout and "unknown_policy" in text.stdout
    assert f"metrics: {scrape.url}" in text.stdout


SECRET_TOOL = "zq_quarterly_payroll_export"  # distinctive: found nowhere else in a scrape


def _call_tools(d: DaemonHandle) -> None:
    def fail() -> None:
        raise KeyError("nope")

    with Client(d.socket) as c:
        r = c.run(
            f"await tools.{SECRET_TOOL}(a=1, b=2)\n"
            "try:\n    await tools.fail()\nexcept Exception:\n    pass",
            tools={SECRET_TOOL: lambda a, b: a + b, "fail": fail},
        )
    assert r.status == "ok", r.error


def test_tool_calls_are_counted_by_policy_without_tool_names(
    md: tuple[DaemonHandle, Scraper]
) -> None:
    """By default the endpoint counts tool calls per policy and outcome, and names no tool:
    whoever can scrape would otherwise learn every user's tool names, which ``jaild stats``
    shows root only. Root's ``jaild stats`` still has them."""
    d, scrape = md
    before_ok = scrape.value("jaild_tool_calls_total", policy="default", outcome="ok")
    _call_tools(d)
    with urllib.request.urlopen(scrape.url, timeout=guard(10)) as response:
        text = response.read().decode()
    assert SECRET_TOOL not in text and 'tool="' not in text
    assert scrape.value("jaild_tool_calls_total", policy="default", outcome="ok") == before_ok + 1
    failed = {
        dict(labels)["outcome"]: v for (name, labels), v in scrape.samples().items()
        if name == "jaild_tool_calls_total" and dict(labels)["outcome"] != "ok"
    }
    assert sum(failed.values()) >= 1, failed
    assert scrape.value("jaild_tool_call_duration_seconds_count", policy="default") >= 2
    out = jaild_cli("stats", "--socket", d.socket)
    assert "TOOL CALLS" in out.stdout and f" {SECRET_TOOL} " in out.stdout


def test_tool_names_are_labels_when_configured(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path
) -> None:
    """The control: with ``daemon.metrics_tool_labels = true`` the same calls are scraped
    by tool and outcome, the tool's name a label."""
    port = free_port()
    config = write_config(tmp_path, f'[daemon]\nmetrics_address = "127.0.0.1:{port}"\n'
                                    "metrics_tool_labels = true\n")
    d = private_daemon({"default": (REPO_POLICIES / "default.toml").read_text()},
                       with_repo_policies=False, args=("--config", config))
    scrape = Scraper(port)
    _call_tools(d)
    assert scrape.value("jaild_tool_calls_total", policy="default", tool=SECRET_TOOL,
                        outcome="ok") == 1
    failed = {
        dict(labels)["outcome"]: v for (name, labels), v in scrape.samples().items()
        if name == "jaild_tool_calls_total" and dict(labels).get("tool") == "fail"
    }
    assert sum(failed.values()) == 1 and "ok" not in failed, failed
    assert scrape.value(
        "jaild_tool_call_duration_seconds_count", policy="default", tool=SECRET_TOOL
    ) == 1


def test_a_port_in_use_stops_the_daemon_with_a_clear_message(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path, f'[daemon]\nmetrics_address = "127.0.0.1:{port}"\n')
        d = private_daemon(
            {"default": (REPO_POLICIES / "default.toml").read_text()},
            with_repo_policies=False, args=("--config", config), wait=False,
        )
        assert d.proc.wait(timeout=guard(60)) == 1, d.log()[-3000:]
    assert (
        f"jaild: cannot start: daemon.metrics_address: cannot listen on '127.0.0.1:{port}': "
        f"port {port} on 127.0.0.1 is already in use"
    ) in d.log()


def _listening_inodes() -> set[str]:
    """Socket inodes of every TCP listener in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def test_without_the_setting_the_daemon_listens_on_no_port(
    private_daemon: Callable[..., DaemonHandle], md: tuple[DaemonHandle, Scraper]
) -> None:
    d = private_daemon({"default": (REPO_POLICIES / "default.toml").read_text()},
                       with_repo_policies=False)
    assert _socket_inodes(d.proc.pid) & _listening_inodes() == set()
    # positive control: the same check finds the metrics daemon's listener
    assert _socket_inodes(md[0].proc.pid) & _listening_inodes()
    with Client(d.socket) as c:
        assert c.stats()["metrics"]["endpoint"] is None


def test_the_daemons_own_self_tests_are_not_user_activity(tmp_path: Path) -> None:
    """Every policy's self-test calls the daemon's inspection tool at start; those calls are
    neither counted in the metrics ``jaild stats`` shows nor audited as a user's (a user's
    call right after is both: the control)."""
    audit = tmp_path / "audit.jsonl"
    config = write_config(tmp_path, f'[daemon]\naudit_log = "{audit}"\n')
    d = start_daemon(tmp_path / "d", args=("--config", config))
    try:
        assert "passed its self-test" in d.log()
        with d.client() as c:
            assert c.stats()["metrics"]["tool_calls"] == {}
            r = c.run("await tools.ping()", tools={"ping": lambda: "pong"})
            assert r.status == "ok", r.error
            assert c.stats()["metrics"]["tool_calls"] == {"default": {"ping": {"ok": 1}}}
        records = [json.loads(line) for line in audit.read_text().splitlines()]
        calls = [r for r in records if r["event"] == "tool_call"]
        assert [(c["tool"], c["uid"]) for c in calls] == [("ping", os.getuid())], calls
    finally:
        assert d.stop() == 0, d.log()[-3000:]
        sweep_cgroups(d)
