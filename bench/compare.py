"""jaild side by side with its alternatives, in one run: writes bench/report.md and
bench/results.json.

``make bench`` runs this. Measured, all on this machine in this run:

1. trivial-job latency: in-process exec, bare nsjail, bubblewrap, Pyodide in Node, the peers
   pydantic-monty (worker pool: warm, cold) and llm-sandbox (bubblewrap and nsjail backends:
   a session per job, and jobs in one open session), and jaild spawn / cold (zygote, no
   pool) / warm (zygote, pool of 4-8), with what each row isolates;
2. fresh-jail jobs per second flat out with 1, 4, 16, 64 clients: jaild vs bare nsjail;
3. tool-call round trips inside one job, against a plain msgpack echo over a Unix socket,
   and pydantic-monty's external-function calls (llm-sandbox has no equivalent);
4. memory: daemon idle, daemon with a pool, PSS per pooled jail, the zygote;
5. 500 concurrent jobs sleeping 1 s: wall time, failures;
6. wall-clock deadlines: how far past its limit a job is ended;
7. fairness: another uid's warm-job latency while root holds its whole per-uid share,
   idle, with sleeping jobs and with spinning ones;
8. over the network: the warm job and the tool-call round trip over mutual TLS on loopback
   beside the same over the Unix socket of the same daemon, and the warm job with liveness
   on (the default bound) and off, taking turns;
10. CPU per fresh jail: the whole machine's CPU over each flat-out run of section 2 (and
   bubblewrap's), divided by its jobs; where it goes in one run of 16 clients (``perf``:
   daemon, zygote, jails, kernel threads, the client; user and kernel), and what the kernel
   charges for each stage of a fresh jail (``bench/floors.py``);
11. sessions that outlive their jail: snapshot, restore, fork(8), pause and resume of a small
   session and of one with numpy and pandas loaded, beside opening a fresh session and
   replaying the code that built the state (``bench/snapshots.py``);
12. redaction: 4,096 secrets over 1 MB of output and of short strings, the automaton beside
   the sort per string it replaced (``bench/redaction.py``);

then a table of targets, met or not. A measurement that fails is reported as such; the
rest of the run goes on.

Usage: python bench/compare.py [--quick] [--out FILE.md] [--json FILE.json] [--runs N]
                               [--profile] [--no-pool-section] [--pyodide-dir DIR] ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import ab
import baselines
import cpu
import flames
import floors
import peers
import redaction
import snapshots
import stages
from foreign import ForeignClient
from jaildrun import (
    FAIRNESS_CONFIG,
    JAILD_CODE,
    PrivateDaemon,
    Transport,
    Variant,
    alternating_latency,
    alternating_tool_calls,
    cores_used,
)
from measure import BenchError, Latency, Throughput, ToolCalls, flat_out_threads, timed
from otlp_sink import OtlpSink
from report import BREAKDOWN_CLIENTS, CPU_LEVELS, Report, Results, Settings, to_json

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_OUT = BENCH / "report.md"
LEVELS = [1, 4, 16, 64]
SHARED_NETNS = Path(__file__).resolve().parent / "shared-netns.toml"
"""The default policy but for ``network.namespace = "tenant"`` (section 13; a unit test keeps
the two equal otherwise)."""
POOL_SIZE = 8
POOL_FILL_GUARD_S = 180.0
"""How long the memory measurement waits for a variant's pool to fill: a liveness guard
only (it goes on as soon as the pool is full). Fixed at 3 s in quick runs before, which a
slow host -- the bench smoke test in a TCG guest, seconds per pooled jail -- could miss,
failing the run with "no pooled jail processes found"."""
FAIRNESS_SHARE = 8  # FAIRNESS_CONFIG's max_jobs = 16: each uid's derived share is half
OTHER_UID = 65534
FLOODS = {
    "sleep_flood": "import time\ntime.sleep(600)",
    "cpu_flood": "while True:\n    pass",
}
TRACED_LABEL = "jaild warm, tracing on (OTLP/HTTP to a sink on loopback)"
TRANSPORT_LABEL = "jaild warm, listening on its Unix socket and on mutual TLS (loopback)"
TRANSPORT_ENDS: dict[str, tuple[bool, Transport]] = {
    "transport_unix": (True, "unix"),
    "transport_tls": (True, "tls"),
    "transport_unix_liveness_off": (False, "unix"),
    "transport_tls_liveness_off": (False, "tls"),
}
"""Section 9's latency rows: key -> (liveness on at both ends?, the transport). The rows with
liveness on and off are two daemons alike but for ``limits.liveness_timeout_s``."""
FAIRNESS = Variant("fairness", "jaild warm (zygote, pool 4-8), max_jobs 16, reachable by nogroup",
                   "zygote", 4, 8, config=FAIRNESS_CONFIG, time_limit_s=900)

SNAPSHOT_VARIANTS = {
    "small": Variant("snapshots", "jaild sessions (the default policy as shipped)", None,
                     keep_pool=True),
    "history": Variant("snapshots", "jaild sessions (the default policy as shipped)", None,
                       keep_pool=True),
    "data": Variant("snapshots-data", "jaild sessions (the data policy as shipped: its "
                    "zygote preimports numpy and pandas)", None,
                    base=REPO / "policies" / "data.toml", keep_pool=True),
}
"""Section 11's daemons: the shipped policies with their own ``[pool]`` sections."""

T = TypeVar("T")


class Run:
    """One bench run: measurements go into ``results``; a failing one leaves its error."""

    def __init__(self, results: Results, profile_dir: Path | None) -> None:
        self.results = results
        self.settings = results.settings
        self.profile_dir = profile_dir

    def attempt(self, key: str, measure: Callable[[], T]) -> T | None:
        print(f"-- {key}", flush=True)
        try:
            return measure()
        except Exception as exc:
            self.failed(key, exc)
            return None

    def failed(self, key: str, exc: Exception) -> None:
        if not isinstance(exc, BenchError | OSError):
            traceback.print_exc()  # a bug in the bench, or something unexpected from jaild
        self.results.errors[key] = f"{type(exc).__name__}: {exc}"
        print(f"   failed: {key}: {self.results.errors[key]}", flush=True)

    def measure_baselines(self, pyodide_dir: str) -> None:
        s, r = self.settings, self.results
        jobs: dict[str, Callable[[], Callable[[], None]]] = {
            "exec": lambda: baselines.in_process,
            "python": baselines.bare_python,
            "nsjail": baselines.bare_nsjail,
            "bwrap": baselines.bubblewrap,
        }
        if not s.quick or baselines.pyodide_installed(pyodide_dir):
            jobs["pyodide"] = lambda: baselines.pyodide(pyodide_dir)
        for key, make in jobs.items():
            runs, warmup = (s.pyodide_runs, 1) if key == "pyodide" else (s.runs, 2)
            latency = self.attempt(
                f"{key}/latency", functools.partial(_time_job, make, runs, warmup)
            )
            if latency is not None:
                r.latency[key] = latency
        if "pyodide" not in jobs:
            r.skipped["pyodide/latency"] = "quick run, and Pyodide is not installed"

        floor = self.attempt(
            "floor/tool_calls",
            lambda: asyncio.run(baselines.unix_echo(s.tool_calls, s.tool_window)),
        )
        if floor is not None:
            r.tool_calls["floor"] = floor

        nsjail_job = self.attempt("nsjail/throughput", baselines.bare_nsjail)
        if nsjail_job is not None:
            for level in s.levels:
                t = self.attempt(
                    f"nsjail/throughput/{level}",
                    functools.partial(flat_out_threads, nsjail_job, level, s.seconds_per_level),
                )
                if t is not None:
                    r.throughput.setdefault("nsjail", []).append(t)
            self.measure_breakdown(
                "nsjail",
                lambda: flat_out_threads(nsjail_job, BREAKDOWN_CLIENTS, s.seconds_per_level),
                dict,
            )
        bwrap_job = self.attempt("bwrap/throughput", baselines.bubblewrap)
        if bwrap_job is not None:  # the other per-job peer that runs flat out
            for level in CPU_LEVELS:
                t = self.attempt(
                    f"bwrap/throughput/{level}",
                    functools.partial(flat_out_threads, bwrap_job, level, s.seconds_per_level),
                )
                if t is not None:
                    r.throughput.setdefault("bwrap", []).append(t)

    def measure_breakdown(
        self, key: str, run: Callable[[], Throughput], roles: Callable[[], dict[int, str]],
    ) -> None:
        """Where a flat-out run's CPU goes (``bench/cpu.py``), at BREAKDOWN_CLIENTS clients."""
        why = cpu.perf_missing()
        if why:  # make bench installs it (bench-tools); the smoke run does without
            where = self.results.skipped if self.settings.quick else self.results.errors
            where[f"{key}/breakdown"] = why
            return
        done = self.attempt(
            f"{key}/breakdown",
            lambda: cpu.breakdown(run, roles, os.getpid()),
        )
        if done is not None:
            self.results.breakdown[key] = done[1]

    def measure_floors(self) -> None:
        """This machine's floors (``bench/floors.py``): a hop between processes on one CPU
        and across two, a warm job's hops with nothing in them, and what idling between
        jobs costs the next piece of Python."""
        s, r = self.settings, self.results
        print("== this machine's floors", flush=True)
        for key in floors.FLOORS:
            x = self.attempt(f"floors/{key}",
                             functools.partial(floors.measure, key, s.runs, s.warm_pause_s))
            if x is not None:
                r.floors[key] = x
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        for key in floors.STAGES:  # a quick run: once each, a third of the operations
            if key in floors.V2_ONLY and not v2:
                continue
            runs, times = (floors.STAGE_RUNS // 3, 1) if s.quick else (floors.STAGE_RUNS, 3)
            cost = self.attempt(f"stages/{key}",
                                functools.partial(_median_stage, key, runs, times))
            if cost is not None:
                r.stage_floors[key] = cost

    def measure_peers(self) -> None:
        """pydantic-monty and llm-sandbox: latency, monty's external calls, and what each
        isolates as read in this run. A peer not installed is skipped in a quick run (the
        smoke run needs no PyPI) and an error otherwise (``make bench`` installs it)."""
        s, r = self.settings, self.results
        r.skipped["monty_exec/latency"] = peers.NO_IN_PROCESS
        r.skipped["llm/tool_calls"] = peers.NO_TOOL_CALLS
        monty: dict[str, Callable[[], object]] = {
            "monty_warm/latency": lambda: peers.monty_warm(s.runs, 2),
            "monty_cold/latency": lambda: peers.monty_cold(s.runs, 2),
            "monty/tool_calls": lambda: peers.monty_tool_calls(s.tool_calls, s.tool_window),
            "monty/evidence": peers.monty_evidence,
        }
        llm: dict[str, Callable[[], object]] = {}
        for backend, key in (("bubblewrap", "llm_bwrap"), ("nsjail", "llm_nsjail")):
            job = functools.partial(peers.llm_sandbox_job, backend)
            llm[f"{key}/latency"] = functools.partial(_time_job, job, s.runs, 2)
            llm[f"{key}_session/latency"] = functools.partial(
                peers.llm_sandbox_in_session, backend, s.runs, 2)
            llm[f"{key}/evidence"] = functools.partial(peers.llm_sandbox_evidence, backend)
        for distribution, measures in ((peers.MONTY, monty), (peers.LLM_SANDBOX, llm)):
            why = peers.missing(distribution)
            print(f"== {distribution}: {why or 'installed'}", flush=True)
            for name, measure in measures.items():
                if why and s.quick:
                    r.skipped[name] = f"quick run, and {why}"
                    continue
                self._keep(name, self.attempt(name, functools.partial(_needs, why, measure)))

    def _keep(self, name: str, value: object) -> None:
        """File a peer's measurement ``KEY/KIND`` under its kind."""
        key, kind = name.split("/")
        r = self.results
        if isinstance(value, Latency) and kind == "latency":
            r.latency[key] = value
        elif isinstance(value, ToolCalls):
            r.tool_calls[key] = value
        elif isinstance(value, str) and kind == "evidence":
            r.evidence[key] = value

    def measure_variant(self, variant: Variant) -> None:
        """Start the variant's daemon, measure what applies to it, stop it."""
        s, r, key = self.settings, self.results, variant.key
        print(f"== {variant.label}", flush=True)
        try:
            with PrivateDaemon(variant) as daemon:
                if key == "warm_uvloop":
                    self.measure_loop(daemon)
                    return
                if key == "warm_pinned":
                    self.measure_pinned(daemon)
                    return
                memory = self.attempt(
                    f"{key}/memory",
                    # a liveness guard, not a setting: it returns once the pool is full (a slow
                    # host -- the smoke run under TCG -- takes seconds per pooled jail)
                    lambda: daemon.settled_snapshot(variant.pool_min, POOL_FILL_GUARD_S),
                )
                if memory is not None:
                    r.memory[key] = memory
                    if key == "pool" and not memory.pooled_jails:
                        why = "no pooled jail processes found under the daemon"
                        if s.pool_section:
                            r.errors["pool/jails"] = why
                        else:
                            r.skipped["pool/jails"] = f"{why} (no [pool] section)"
                if key == "pool":
                    return
                pause = s.warm_pause_s if key == "warm" else 0.0
                latency = self.attempt(f"{key}/latency", lambda: daemon.latency(s.runs, pause))
                if latency is not None:
                    latency.note = f"{pause * 1e3:.0f} ms between jobs" if pause else ""
                    r.latency[key] = latency
                if key == "warm":
                    blocking = self.attempt(
                        "warm_blocking/latency",
                        lambda: daemon.latency(s.runs, pause, blocking=True),
                    )
                    if blocking is not None:
                        blocking.note = f"{pause * 1e3:.0f} ms between jobs"
                        r.latency["warm_blocking"] = blocking
                for level in s.levels:
                    t = self.attempt(
                        f"{key}/throughput/{level}",
                        functools.partial(daemon.throughput, level, s.seconds_per_level),
                    )
                    if t is not None:
                        r.throughput.setdefault(key, []).append(t)
                if key in ("cold", "warm"):
                    self.measure_breakdown(
                        key,
                        functools.partial(daemon.throughput, BREAKDOWN_CLIENTS,
                                          s.seconds_per_level),
                        lambda: {daemon.pid: "daemon",
                                 **dict.fromkeys(cpu.zygote_pids(daemon.pid), "zygote")},
                    )
                if key == "cold":
                    pages = self.attempt("cold/jail_pages",
                                         lambda: daemon.jail_pages(max(3, s.runs // 5)))
                    if pages is not None:
                        r.jail_pages = pages
                tools = self.attempt(
                    f"{key}/tool_calls", lambda: daemon.tool_calls(s.tool_calls, s.tool_window)
                )
                if tools is not None:
                    r.tool_calls[key] = tools
                if key == "cold":
                    r.sleep = self.attempt(
                        "cold/sleep", lambda: daemon.sleep_burst(s.sleep_jobs, s.sleep_clients)
                    )
                    r.deadlines = self.attempt(
                        "cold/deadlines",
                        lambda: daemon.deadlines(s.deadline_runs, s.deadline_limit_s),
                    )
                if self.profile_dir is not None and key in ("cold", "warm"):
                    self.profile(daemon, pause)
        except Exception as exc:  # the daemon did not start: the other variants still run
            self.failed(f"{key}/start", exc)

    def measure_traced(self, warm: Variant) -> None:
        """The warm rows again with tracing on: the daemon exports its spans (OTLP/HTTP,
        the SDK's batching as it comes) to a sink on loopback in this process, which keeps
        the bytes and answers at once; what tracing costs, against the warm rows of the same
        run. Then the sink's spans are counted: they must be there (else the rows measured
        nothing)."""
        s, r = self.settings, self.results
        with OtlpSink() as sink:
            variant = dataclasses.replace(
                warm, key="warm_traced", label=TRACED_LABEL, env=tuple(sink.environment().items()))
            print(f"== {variant.label}", flush=True)
            try:
                with PrivateDaemon(variant) as daemon:
                    pause = s.warm_pause_s
                    latency = self.attempt("warm_traced/latency",
                                           lambda: daemon.latency(s.runs, pause))
                    if latency is not None:
                        latency.note = f"{pause * 1e3:.0f} ms between jobs"
                        r.latency["warm_traced"] = latency
                    tools = self.attempt("warm_traced/tool_calls",
                                         lambda: daemon.tool_calls(s.tool_calls, s.tool_window))
                    if tools is not None:
                        r.tool_calls["warm_traced"] = tools
            except Exception as exc:
                self.failed("warm_traced/start", exc)
                return
            # stopped: the spans still queued went out at its stop
            spans = self.attempt("warm_traced/spans", sink.spans)
        if spans is None:
            return
        r.tracing = {"export_requests": len(sink.bodies),
                     "exported_bytes": sum(map(len, sink.bodies)), **spans}
        jobs = spans.get("jaild.job", 0)
        expected = (s.runs + 2 if "warm_traced" in r.latency else 0) + (
            1 if "warm_traced" in r.tool_calls else 0)  # the latency rows' warm-up included
        if jobs < expected:
            self.failed("warm_traced/spans", BenchError(
                f"the sink got {jobs} job spans for {expected} jobs: tracing was not on"))

    def measure_transports(self, warm: Variant) -> None:
        """The warm job over mutual TLS on loopback beside the Unix socket, against one daemon
        listening on both (only the transport differs), and with liveness on (the default
        bound) and off: a second daemon alike but for ``limits.liveness_timeout_s = 0`` (its
        clients' off too). The four rows' clients take turns job by job; the tool-call jobs
        go over each transport of the first daemon, A B B A."""
        s, r = self.settings, self.results
        on = dataclasses.replace(warm, key="transport", label=TRANSPORT_LABEL, tls=True)
        off = dataclasses.replace(on, key="transport_liveness_off",
                                  label=f"{TRANSPORT_LABEL}, liveness off", liveness_timeout_s=0)
        print(f"== {on.label}; and a second daemon, liveness off", flush=True)
        try:
            with PrivateDaemon(on) as live, PrivateDaemon(off) as unlive:
                for daemon in (live, unlive):  # as the warm row, which waits for it (memory)
                    daemon.filled(warm.pool_min, POOL_FILL_GUARD_S)
                ends = {key: (live if liveness else unlive, transport)
                        for key, (liveness, transport) in TRANSPORT_ENDS.items()}
                pause = s.warm_pause_s
                latency = self.attempt("transport/latency", lambda: alternating_latency(
                    ends, s.runs, pause, warm.event_loop))
                for key, x in (latency or {}).items():
                    x.note = f"{pause * 1e3:.0f} ms between jobs"
                    r.latency[key] = x
                tools = self.attempt("transport/tool_calls", lambda: alternating_tool_calls(
                    live, ["unix", "tls"], s.tool_calls, s.tool_window))
                for transport, t in (tools or {}).items():
                    r.tool_calls[f"transport_{transport}"] = t
        except Exception as exc:
            self.failed("transport/start", exc)

    def measure_loop(self, daemon: PrivateDaemon) -> None:
        """The warm rows again with daemon and client on uvloop (``daemon.event_loop``,
        ``jaild.loops``): what it changes against the standard loop, in the same run."""
        s, r, key = self.settings, self.results, daemon.variant.key
        pause = s.warm_pause_s
        for name, blocking in ((key, False), (f"{key}_blocking", True)):
            latency = self.attempt(
                f"{name}/latency", functools.partial(daemon.latency, s.runs, pause,
                                                     blocking=blocking))
            if latency is not None:
                latency.note = f"{pause * 1e3:.0f} ms between jobs"
                r.latency[name] = latency
        tools = self.attempt(
            f"{key}/tool_calls", lambda: daemon.tool_calls(s.tool_calls, s.tool_window)
        )
        if tools is not None:
            r.tool_calls[key] = tools

    def measure_pinned(self, daemon: PrivateDaemon) -> None:
        """The warm rows with the daemon, its zygote, its jails and the client all on one
        CPU: whether keeping the hops off the other CPU (no cross-CPU wake-ups) pays, against
        losing that CPU for everything else (the pool's refills, other jobs)."""
        s, r, key = self.settings, self.results, daemon.variant.key
        assert daemon.variant.cpus is not None
        with floors.on_cpus(daemon.variant.cpus):
            latency = self.attempt(f"{key}/latency",
                                   functools.partial(daemon.latency, s.runs, s.warm_pause_s))
            if latency is not None:
                latency.note = f"{s.warm_pause_s * 1e3:.0f} ms between jobs"
                r.latency[key] = latency
            tools = self.attempt(
                f"{key}/tool_calls", lambda: daemon.tool_calls(s.tool_calls, s.tool_window)
            )
        if tools is not None:
            r.tool_calls[key] = tools

    def measure_stages(self) -> None:
        """Where a warm job's time goes: per-stage timestamps (``bench/stages.py``)."""
        s, r = self.settings, self.results
        variant = next(v for v in variants(s.pool_section) if v.key == "warm")
        print("== stages of a warm job", flush=True)
        # the daemon's notes are read into the split, then go with their directory
        with tempfile.TemporaryDirectory(prefix="jaild-bench-stages-") as notes:
            split = self.attempt(
                "warm/stages",
                lambda: stages.measure(variant, JAILD_CODE, s.runs, s.warm_pause_s, Path(notes)),
            )
        if split is not None:
            r.stages = split

    def measure_levers(self, warm: Variant) -> None:
        """Section 13: each lever off and on, two daemons taking turns at BREAKDOWN_CLIENTS
        clients flat out (off, on, three times; once each in a quick run), everything else as
        ``warm``; first all of them at once, ``levers_base``'s daemon (a worktree of that
        revision, as ``make bench-ab`` starts it) beside this checkout's."""
        s = self.settings
        with tempfile.TemporaryDirectory(prefix="jaild-bench-base-") as tmp:
            tree = Path(tmp) / "base"
            try:
                ab.worktree(s.levers_base, tree)
            except subprocess.CalledProcessError as exc:
                self.failed("levers/code", BenchError(f"git worktree {s.levers_base}: {exc}"))
            else:
                try:
                    self._turns("code", dataclasses.replace(
                        warm, key="lever_code_off", env=(("PYTHONPATH", str(tree)),)), warm,
                        ab.base_entry(tree))
                finally:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(tree)], check=False, capture_output=True)
        for key, (off, on) in lever_variants(warm).items():
            self._turns(key, off, on)

    def _turns(self, key: str, off: Variant, on: Variant,
               off_entry: tuple[str, ...] = ("-m", "jaild")) -> None:
        """Lever ``key``: ``off`` and ``on`` flat out in turns (section 13)."""
        s = self.settings
        print(f"== lever {key}", flush=True)
        try:
            with PrivateDaemon(off, off_entry) as d_off, PrivateDaemon(on) as d_on:
                runs: dict[str, list[Throughput]] = {"off": [], "on": []}
                for _ in range(1 if s.quick else 3):
                    for side, daemon in (("off", d_off), ("on", d_on)):
                        runs[side].append(daemon.throughput(BREAKDOWN_CLIENTS,
                                                            s.seconds_per_level))
                self.results.levers[key] = runs
        except Exception as exc:
            self.failed(f"levers/{key}", exc)

    def measure_snapshots(self) -> None:
        """Section 11: snapshots of a small session and of a numpy/pandas one, beside a fresh
        session and a replay of the code that built the state (``bench/snapshots.py``)."""
        s, r = self.settings, self.results
        runs = max(3, s.runs // 10)
        for kind, variant in SNAPSHOT_VARIANTS.items():
            print(f"== snapshots: {variant.label}", flush=True)
            x = self.attempt(f"snapshots/{kind}",
                             functools.partial(snapshots.measure, kind, variant, runs))
            if x is not None:
                r.snapshots[kind] = x

    def measure_redaction(self) -> None:
        """Section 12: redaction's cost, the automaton beside the sort per string
        (``bench/redaction.py``; in this process, no daemon)."""
        print("== redaction", flush=True)
        x = self.attempt("redaction", lambda: redaction.measure(self.settings.quick))
        if x is not None:
            self.results.redaction = x

    def measure_fairness(self) -> None:
        """uid 65534's warm-job latency on one daemon: idle, then while root holds its whole
        share with sleeping jobs, then with spinning ones (each flood cancelled after)."""
        s, r = self.settings, self.results
        if os.geteuid() != 0:
            r.skipped["fairness/idle"] = "needs root, to run the other uid's client"
            return
        print(f"== {FAIRNESS.label}", flush=True)
        try:
            with PrivateDaemon(FAIRNESS) as daemon, ForeignClient() as foreign:

                def other_uid() -> Latency:
                    return foreign.latency(daemon.socket, daemon.policy, s.fairness_runs,
                                           s.warm_pause_s, uid=OTHER_UID)

                def during(code: str) -> Latency:
                    with daemon.flooded(code, s.fairness_share, settle_s=2.0) as ended:
                        latency = other_uid()
                    latency.note = f"uid 0's jobs used {cores_used(ended):.2f} cores"
                    return latency

                idle = self.attempt("fairness/idle", other_uid)
                if idle is not None:
                    r.fairness["idle"] = idle
                for key, code in FLOODS.items():
                    x = self.attempt(f"fairness/{key}", functools.partial(during, code))
                    if x is not None:
                        r.fairness[key] = x
        except Exception as exc:
            self.failed("fairness/start", exc)

    def profile(self, daemon: PrivateDaemon, pause_s: float) -> None:
        assert self.profile_dir is not None
        key = daemon.variant.key
        out = self.profile_dir / f"{key}.txt"

        def record() -> flames.Flame:
            with flames.recording(daemon.pid, out):
                daemon.latency(self.settings.runs, pause_s)
            return flames.summarize(out.read_text())

        flame = self.attempt(f"{key}/profile", record)
        if flame is not None:
            self.results.profiles[key] = flame


def _time_job(make: Callable[[], Callable[[], None]], runs: int, warmup: int) -> Latency:
    """Make the job (which may fail: a tool is missing), then time it."""
    return timed(make(), runs, warmup=warmup)


def _median_stage(key: str, runs: int, times: int) -> float:
    """The median of ``times`` measurements of stage floor ``key`` (``floors.STAGES``)."""
    return sorted(floors.measure_stage(key, runs) for _ in range(times))[times // 2]


def _needs(missing: str | None, measure: Callable[[], T]) -> T:
    """``measure()``, unless what it needs is ``missing``."""
    if missing:
        raise BenchError(missing)
    return measure()


def variants(pool_section: bool) -> list[Variant]:
    def mode(m: str) -> str | None:
        return m if pool_section else None

    today = "" if pool_section else " [no [pool] section]"
    return [
        Variant("spawn", f"jaild spawn (full nsjail per job){today}", mode("spawn")),
        Variant("cold", f"jaild cold (zygote, pool 0){today}", mode("zygote")),
        Variant("warm", f"jaild warm (zygote, pool 4-8){today}", mode("zygote"), 4, 8),
        Variant("warm_uvloop", f"jaild warm, daemon and client on uvloop{today}",
                mode("zygote"), 4, 8, event_loop="uvloop"),
        Variant("warm_pinned", f"jaild warm, daemon, jails and client on one CPU{today}",
                mode("zygote"), 4, 8, cpus=str(min(os.sched_getaffinity(0)))),
        Variant("pool", f"jaild pool of {POOL_SIZE} (memory only){today}", mode("zygote"),
                POOL_SIZE, POOL_SIZE),
    ]


def lever_variants(warm: Variant) -> dict[str, tuple[Variant, Variant]]:
    """Section 13's daemons: lever -> (off, on), each ``warm`` but for the lever."""
    levers = {
        "seccomp": (dataclasses.replace(warm, key="lever_seccomp_off", zygote_seccomp="whole"),
                    dataclasses.replace(warm, key="lever_seccomp_on")),
        "netns": (dataclasses.replace(warm, key="lever_netns_off"),
                  dataclasses.replace(warm, key="lever_netns_on", base=SHARED_NETNS)),
    }
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # cgroup v2: clone3 is a lever
        levers["clone3"] = (
            dataclasses.replace(warm, key="lever_clone3_off", clone_into_cgroup=False),
            dataclasses.replace(warm, key="lever_clone3_on"))
    return levers


def labels(vs: list[Variant]) -> dict[str, str]:
    out = {
        "exec": "in-process `exec` (floor)",
        "python": "python subprocess per job (no isolation)",
        "nsjail": "bare nsjail + python per job",
        "bwrap": "bubblewrap + python per job",
        "pyodide": "Pyodide in a fresh Node per job",
        "floor": "asyncio Unix-socket msgpack echo (floor)",
        "warm_blocking": "jaild warm, blocking `Client` (zygote, pool 4-8)",
        "warm_uvloop_blocking": "jaild warm, blocking `Client`, daemon and client on uvloop",
        "warm_traced": TRACED_LABEL,
        "transport_unix": "jaild warm over its Unix socket",
        "transport_tls": "jaild warm over mutual TLS on loopback (the same daemon)",
        "transport_unix_liveness_off": "jaild warm over its Unix socket, liveness off",
        "transport_tls_liveness_off": "jaild warm over mutual TLS on loopback, liveness off",
        "fairness": FAIRNESS.label,
        "monty_exec": "pydantic-monty in-process",
        "monty_warm": "pydantic-monty, warm worker pool (a checkout per job)",
        "monty_cold": "pydantic-monty, cold (a new pool and worker per job, its shutdown "
                      "untimed)",
        "monty": "pydantic-monty external function, `AsyncMonty`",
        "llm_bwrap": "llm-sandbox bubblewrap, a session per job (open, run, close)",
        "llm_bwrap_session": "llm-sandbox bubblewrap, in an open session",
        "llm_nsjail": "llm-sandbox nsjail, a session per job (open, run, close)",
        "llm_nsjail_session": "llm-sandbox nsjail, in an open session",
        "llm": "llm-sandbox (bubblewrap, nsjail)",
    }
    return out | {v.key: v.label for v in vs}


JAILD_ISOLATION = (
    "a fresh jail per job (pooled jails are made ahead, never reused): user, pid, mount, net "
    "(no interfaces), ipc, uts and cgroup namespaces; an empty read-only root with the "
    "policy's binds; a per-job uid outside, no capabilities, `no_new_privs`; a seccomp "
    "allow-list; the job's own cgroup (memory, pids, optional CPU) and rlimits; a wall-clock "
    "deadline (docs/security.md)"
)


def isolation() -> dict[str, str]:
    """What each kind of row isolates, keyed as its rows are (``llm_bwrap`` stands for its
    ``_session`` row too, ``jaild`` for every jaild variant)."""
    return {
        "exec": "nothing: the code runs in the bench's own process",
        "python": "nothing but a process boundary: root, the host's namespaces and files",
        "nsjail": "user (uid 65534), pid, mount, net, ipc, uts and cgroup namespaces; read-only "
                  "`/usr` and jail env, no `/proc`; no cgroups, no seccomp (`-Mo -Q`)",
        "bwrap": "all namespaces (`--unshare-all`), uid 65534; read-only `/usr` and jail env, "
                 "private `/proc`, `/dev`, `/tmp`; no cgroups, no seccomp",
        "pyodide": "WebAssembly in a fresh Node process: no system calls of its own; what it "
                   "reaches of the host is what Pyodide's JavaScript bridge gives; Node itself "
                   "runs unconfined",
        "jaild": JAILD_ISOLATION,
        **peers.ISOLATION,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (about a minute): few runs, 50 sleeping jobs, Pyodide only "
                        "if installed; writes to a temporary directory unless --out")
    p.add_argument("--out", type=Path, help=f"Markdown report (default: {DEFAULT_OUT})")
    p.add_argument("--json", type=Path,
                   help="raw numbers (default: results.json beside the default report, else "
                        "the report's path with .json)")
    p.add_argument("--runs", type=int, help="sequential jobs per latency row (200; quick 15)")
    p.add_argument("--pyodide-runs", type=int, help="Pyodide jobs (5; quick 2)")
    p.add_argument("--seconds", type=float, help="seconds per throughput level (4; quick 1)")
    p.add_argument("--tool-calls", type=int, help="tool calls per mode (1000; quick 200)")
    p.add_argument("--sleep-jobs", type=int, help="concurrent sleeping jobs (500; quick 50)")
    p.add_argument("--deadline-runs", type=int,
                   help="jobs cut by a 0.5 s wall-clock limit (30; quick 5)")
    p.add_argument("--levels", type=lambda v: [int(n) for n in v.split(",")],
                   help=f"concurrent clients per throughput row, comma-separated "
                        f"({','.join(map(str, LEVELS))}); bubblewrap's rows run "
                        f"{','.join(map(str, CPU_LEVELS))} whatever this says")
    p.add_argument("--fairness-runs", type=int,
                   help="uid 65534's jobs per fairness phase (100; quick 10)")
    p.add_argument("--levers-base", default="ade73d8",
                   help="the revision section 13's first row sets this checkout beside "
                        "(ade73d8: where issue 45 began)")
    p.add_argument("--pyodide-dir", default=baselines.DEFAULT_PYODIDE_DIR,
                   help="directory holding node_modules/pyodide")
    p.add_argument("--profile", action="store_true",
                   help="also profile the daemon with py-spy during cold and warm runs")
    p.add_argument("--no-pool-section", dest="pool_section", action="store_false",
                   help="policies without a [pool] section (daemons that do not know it)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    quick = args.quick

    def pick(value: T | None, full: T, smoke: T) -> T:
        return value if value is not None else smoke if quick else full

    settings = Settings(
        command=shlex.join(["bench/compare.py", *argv]),
        quick=quick,
        pool_section=args.pool_section,
        profile=args.profile,
        runs=pick(args.runs, 200, 15),
        pyodide_runs=pick(args.pyodide_runs, 5, 2),
        warm_pause_s=0.020,
        seconds_per_level=pick(args.seconds, 4.0, 1.0),
        levels=args.levels or LEVELS,
        tool_calls=pick(args.tool_calls, 1000, 200),
        tool_window=100,
        sleep_jobs=pick(args.sleep_jobs, 500, 50),
        sleep_clients=4,
        pool_size=POOL_SIZE,
        deadline_runs=pick(args.deadline_runs, 30, 5),
        deadline_limit_s=0.5,
        fairness_runs=pick(args.fairness_runs, 100, 10),
        fairness_share=FAIRNESS_SHARE,
        levers_base=args.levers_base,
    )
    out: Path = args.out or (
        Path(tempfile.mkdtemp(prefix="jaild-bench-")) / "report.md" if quick else DEFAULT_OUT
    )
    json_out: Path = args.json or (
        BENCH / "results.json" if out.resolve() == DEFAULT_OUT else out.with_suffix(".json")
    )
    vs = variants(args.pool_section)
    machine = baselines.machine(REPO, args.pyodide_dir) | peers.versions()
    results = Results(machine, settings, labels(vs), isolation=isolation())
    profile_dir = None
    if args.profile:
        profile_dir = Path(tempfile.mkdtemp(prefix="jaild-bench-profile-"))
        results.profile_dir = str(profile_dir)
    run = Run(results, profile_dir)
    run.measure_floors()
    run.measure_baselines(args.pyodide_dir)
    run.measure_peers()
    for variant in vs:
        run.measure_variant(variant)
        if variant.key == "warm":  # the same daemon with tracing on, next; then over TLS
            run.measure_traced(variant)
            run.measure_transports(variant)
            run.measure_levers(variant)
    run.measure_stages()
    run.measure_fairness()
    run.measure_snapshots()
    run.measure_redaction()
    results.machine["load average at end"] = baselines.load_average()

    report = Report(results).render()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    json_out.write_text(to_json(results))
    print(report)
    print(f"wrote {out} and {json_out}")
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
