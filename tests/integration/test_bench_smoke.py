"""`make bench` keeps working: its harness, run briefly against real daemons and baselines.

No figure is asserted (speed lives in bench/report.md, never in tests); only that every
measurement of every alternative could be made and the report says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.conftest import REPO, guard

pytestmark = pytest.mark.integration


def test_the_benchmark_harness_runs_every_measurement(tmp_path: Path, world_dir: Path) -> None:
    out = tmp_path / "report.md"
    # its own process group: a harness that hangs is stopped with the daemons it started
    # (SIGTERM first: a daemon removes its cgroups as it stops), not left running.
    # Its temporary directories go in a TMPDIR of its own (traversable by the jailed uid, as
    # /tmp is), which must be empty after: every run of make test left a jaild-bench-stages-*
    # in /tmp, unseen among other suites' and benches' entries there.
    # Two throughput levels of the four (1 and 16, a CPU target's): every row's code runs; 64
    # clients of full-nsjail spawns alone were 9 s of the smoke run on two cores.
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "compare.py"), "--quick", "--runs", "4",
         "--seconds", "0.3", "--tool-calls", "50", "--sleep-jobs", "20", "--deadline-runs", "3",
         "--fairness-runs", "4", "--levels", "1,16", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(world_dir)},
    )
    try:
        stdout, stderr = proc.communicate(timeout=guard(600))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    run = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    failed = [line for line in run.stdout.splitlines() if line.lstrip().startswith("failed:")]
    assert run.returncode == 0, (  # which measurement failed first, wherever it is in the log
        "\n".join(failed) + "\n---\n" + run.stdout[-3000:] + run.stderr[-3000:])
    assert sorted(p.name for p in world_dir.iterdir()) == [], "the harness left temporary files"
    report = out.read_text()
    for section in ("## This machine's floors", "## Targets", "## 1. Job latency", "### What each row isolates",
                    "## 2. Fresh-jail jobs per second",
                    "## 3. Tool-call round trip", "## 4. Memory", "## 5. Concurrent sleeping jobs",
                    "## 6. Wall-clock deadlines", "## 7. Fairness between uids",
                    "## 8. Where a warm job's time goes",
                    "## 9. Over mutual TLS, and what liveness costs",
                    "## 10. CPU per fresh jail, and where it goes",
                    "## 11. Sessions that outlive their jail: snapshot, restore, fork, pause",
                    "## 12. Redaction"):
        assert section in report
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["errors"] == {}, results["errors"]
    assert [r["what"] for r in results["redaction"]][:1] == ["output: one text"]
    for kind in ("small", "history", "data"):  # section 11: every figure, every round
        costs = results["snapshots"][kind]
        assert costs["bytes"] > 0, kind
        for what in ("snapshot", "restore", "fresh", "replay", "fork", "pause", "resume"):
            assert len(costs[what]["samples_s"]) == 3, (kind, what)
    for key in ("exec", "nsjail", "bwrap", "spawn", "cold", "warm", "warm_blocking",
                "warm_uvloop", "warm_uvloop_blocking", "warm_traced", "warm_pinned"):
        assert results["latency"][key]["samples_s"], key
    # the default loop, uvloop, traced, and everything on one CPU
    for key in ("warm", "warm_uvloop", "warm_traced", "warm_pinned"):
        assert results["tool_calls"][key]["sequential_s"], key
    for key in ("pingpong_same", "pingpong_apart", "pingpong_paced", "shape", "decode_hot",
                "decode_idle"):  # this machine's floors
        assert len(results["floors"][key]["samples_s"]) == 4, key
    assert len(results["floors"]["tool_shape"]["samples_s"]) == 40  # ten times the runs
    # CPU per fresh jail: each stage's floor, the whole machine's CPU of every flat-out run,
    # the pages a jail copies, and (where perf is) who burnt it
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()  # clone3 into a cgroup: v2's
    assert set(results["stage_floors"]) == {"fork_exit", "namespaces", "netns", "cgroup",
                                            "seccomp", "seccomp_split", "cow",
                                            *(["cgroup_clone3"] if v2 else [])}
    assert all(isinstance(v, float) for v in results["stage_floors"].values())
    # section 13: each lever off and on, a turn each in a quick run
    assert set(results["levers"]) == {"code", "seccomp", "netns", *(["clone3"] if v2 else [])}
    for lever in results["levers"].values():
        assert [len(lever["off"]), len(lever["on"])] == [1, 1]
        assert all(run["jobs"] > 0 and run["failures"] == 0
                   for run in (*lever["off"], *lever["on"]))
    for key in ("nsjail", "bwrap", "spawn", "cold", "warm"):
        runs = results["throughput"][key]
        assert runs and all(t["cpu_s"] > 0 and t["cpu_per_job_s"] > 0 for t in runs), key
        assert [t["concurrency"] for t in runs] == ([16, 64] if key == "bwrap" else [1, 16]), key
    assert results["jail_pages"] > 0
    if shutil.which("perf"):
        breakdown = results["breakdown"]
        assert sum(breakdown["nsjail"]["where"]["jailed python"]) > 0
        for key in ("cold", "warm"):
            assert sum(breakdown[key]["where"]["jail"]) > 0, key
            assert sum(breakdown[key]["where"]["daemon"]) > 0, key
    else:
        assert "nsjail/breakdown" in results["skipped"]
    # the traced rows measured tracing: every job's spans reached the sink (4 + 2 warm-up
    # jobs and the tool-call job; its 2 x 50 calls each a span)
    assert results["tracing"]["jaild.job"] >= 7, results["tracing"]
    assert results["tracing"]["jaild.tool_call"] >= 100, results["tracing"]
    assert "Tracing on (`OTEL_TRACES_EXPORTER=otlp`" in report
    stages = results["stages"]  # each of the 4 jobs split into the six stages
    assert list(stages) == ["client send", "admit + place", "jail", "record", "to client",
                            "client return"]
    assert all(len(v) == 4 and min(v) >= 0 for v in stages.values()), stages
    assert len(results["deadlines"]["samples_s"]) == 3
    # one daemon over its Unix socket and over mutual TLS, and one alike with liveness off,
    # the four clients taking turns (4 jobs each); the tool-call job over each transport, twice
    for key in ("transport_unix", "transport_tls", "transport_unix_liveness_off",
                "transport_tls_liveness_off"):
        assert len(results["latency"][key]["samples_s"]) == 4, key
    for key in ("transport_unix", "transport_tls"):
        assert len(results["tool_calls"][key]["sequential_s"]) == 2 * 50, key
    for phase in ("idle", "sleep_flood", "cpu_flood"):  # another uid's jobs, under each
        assert results["fairness"][phase]["samples_s"], phase

    # The peers (the [bench] extra): measured when installed, else skipped as not installed.
    # What they do not offer is said either way.
    assert "no in-process execution" in results["skipped"]["monty_exec/latency"]
    assert "no tool-call equivalent" in results["skipped"]["llm/tool_calls"]
    peers = {
        "pydantic-monty": (["monty_warm", "monty_cold"], ["monty"], ["monty"]),
        "llm-sandbox": (["llm_bwrap", "llm_bwrap_session", "llm_nsjail", "llm_nsjail_session"],
                        [], ["llm_bwrap", "llm_nsjail"]),
    }
    for distribution, (latency, tool_calls, evidence) in peers.items():
        try:
            metadata.version(distribution)
        except metadata.PackageNotFoundError:
            for key in latency:
                assert "not installed" in results["skipped"][f"{key}/latency"], key
            continue
        for key in latency:
            assert results["latency"][key]["samples_s"], key
        for key in tool_calls:
            assert results["tool_calls"][key]["sequential_s"], key
        for key in evidence:
            assert "namespaces shared with the host" in results["evidence"][key], key
