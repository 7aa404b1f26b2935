"""The results of one bench run, as JSON (raw numbers) and as the Markdown report."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flames
from cpu import BREAKDOWN_ROWS, Breakdown
from floors import FLOORS, STAGES, V2_ONLY
from measure import Deadlines, Latency, SleepBurst, Throughput, ToolCalls, percentile
from procmem import MemorySnapshot
from redaction import RedactionCost
from snapshots import E2B_PAUSE_S_PER_GIB, E2B_RESUME_S, FORKS, HISTORY_RUNS, SnapshotCosts

MIB_KB = 1024
PEER_LATENCY = ("monty_exec", "monty_warm", "monty_cold", "llm_bwrap", "llm_bwrap_session",
                "llm_nsjail", "llm_nsjail_session")
"""Section 1's rows for pydantic-monty and llm-sandbox (``monty_exec``: skipped, saying why)."""
TRANSPORT_ROWS = ("transport_unix", "transport_tls", "transport_unix_liveness_off",
                  "transport_tls_liveness_off")
"""Section 9's latency rows (their clients take turns, in a new order each round)."""
CPU_LEVELS = (16, 64)
"""The levels the CPU-per-jail targets are set at (bubblewrap's flat-out rows run these)."""
BREAKDOWN_CLIENTS = 16
"""Clients of the flat-out run that ``perf`` records for section 10's breakdown."""
LIVENESS_DEFAULT_S = 30.0
"""jaild's liveness bound by default, the daemon's (``limits.liveness_timeout_s``) and the
client's (``liveness_timeout_s``): section 9's rows with liveness on run with it."""
ISOLATION_ROWS = {
    "exec": "in-process `exec`",
    "python": "python subprocess",
    "nsjail": "bare nsjail",
    "bwrap": "bubblewrap",
    "pyodide": "Pyodide",
    "monty": "pydantic-monty (warm, cold, external calls)",
    "llm_bwrap": "llm-sandbox bubblewrap (both rows)",
    "llm_nsjail": "llm-sandbox nsjail (both rows)",
    "jaild": "jaild (spawn, cold, warm)",
}
"""The isolation table's rows: kind (a key of ``Results.isolation``) -> the rows it covers."""

LEVERS: dict[str, str] = {
    "code": "all of issue 45's code at once: the revision it started from (off) against this "
            "checkout (on), each as shipped",
    "seccomp": "the policy's seccomp filters loaded once, in the zygote; each jail adds its "
               "small part (`daemon.zygote_seccomp`: `\"whole\"` off, `\"split\"` on, the "
               "default)",
    "netns": "one network namespace for a tenant's concurrent jails of a policy "
             "(`network.namespace`: `\"jail\"` off, the default; `\"tenant\"` on)",
    "clone3": "a forked jail born in its job's cgroup, on cgroup v2 only "
              "(`daemon.clone_into_cgroup`: false off, moved after its fork; true on, the "
              "default)",
}
"""Section 13's levers: key -> what is switched."""


@dataclass
class Settings:
    """How much of everything one run does."""

    command: str
    quick: bool
    pool_section: bool
    profile: bool
    runs: int
    pyodide_runs: int
    warm_pause_s: float
    seconds_per_level: float
    levels: list[int]
    tool_calls: int
    tool_window: int
    sleep_jobs: int
    sleep_clients: int
    pool_size: int
    deadline_runs: int
    deadline_limit_s: float
    fairness_runs: int
    fairness_share: int
    levers_base: str = "ade73d8"
    """Section 13's first row: the revision this checkout's code is set beside."""


@dataclass
class Results:
    machine: dict[str, str]
    settings: Settings
    labels: dict[str, str]
    """What each key (``exec``, ``nsjail``, ``cold``, ...) stands for, as the report names it."""
    latency: dict[str, Latency] = field(default_factory=dict)
    throughput: dict[str, list[Throughput]] = field(default_factory=dict)
    tool_calls: dict[str, ToolCalls] = field(default_factory=dict)
    memory: dict[str, MemorySnapshot] = field(default_factory=dict)
    sleep: SleepBurst | None = None
    deadlines: Deadlines | None = None
    fairness: dict[str, Latency] = field(default_factory=dict)
    floors: dict[str, Latency] = field(default_factory=dict)
    """This machine's floors (``bench/floors.py``), by key of ``floors.FLOORS``."""
    stage_floors: dict[str, float] = field(default_factory=dict)
    """What the kernel charges for each stage of a fresh jail (``floors.STAGES``): CPU
    seconds per operation, for the whole machine."""
    breakdown: dict[str, Breakdown] = field(default_factory=dict)
    """Key (``nsjail``, ``cold``, ``warm``) -> where a flat-out run's CPU went (perf)."""
    jail_pages: int | None = None
    """Pages a trivial job's jail copied by its code's last line (jaild cold)."""
    stages: dict[str, list[float]] = field(default_factory=dict)
    """A warm job's stages (``bench/stages.py``): each job's seconds per stage."""
    """Phase (``idle``, ``sleep_flood``, ``cpu_flood``) -> uid 65534's warm-job latency."""
    profiles: dict[str, flames.Flame] = field(default_factory=dict)
    profile_dir: str = ""
    isolation: dict[str, str] = field(default_factory=dict)
    """Kind of row (``nsjail``, ``jaild``, ``monty``, ``llm_bwrap``, ...) -> what it isolates."""
    evidence: dict[str, str] = field(default_factory=dict)
    """Peer (``monty``, ``llm_bwrap``, ``llm_nsjail``) -> what this run read of its sandbox:
    the argv it builds, the sandboxed process's uid, capabilities, filters, namespaces."""
    tracing: dict[str, int] = field(default_factory=dict)
    """The traced warm variant's export: ``export_requests``, ``exported_bytes``, and span
    name -> spans the sink got."""
    snapshots: dict[str, SnapshotCosts] = field(default_factory=dict)
    """Section 11: kind of session (``small``, ``data``) -> what its snapshots cost."""
    redaction: list[RedactionCost] = field(default_factory=list)
    """Section 12: redaction's cost, the automaton beside the sort per string it replaced."""
    levers: dict[str, dict[str, list[Throughput]]] = field(default_factory=dict)
    """Section 13: lever (``seccomp``, ``netns``) -> ``on`` / ``off`` -> the flat-out runs of
    jaild warm at BREAKDOWN_CLIENTS clients with the lever on and off, taken in turns."""
    errors: dict[str, str] = field(default_factory=dict)
    """Measurement key (``pyodide/latency``, ``cold/start``, ...) -> why it failed."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Measurement key -> why it was not attempted (not a failure)."""


# ---------------------------------------------------------------------------- JSON


def _jsonable(value: Any) -> Any:
    """Dataclasses become dicts of their fields *and* their computed properties; floats are
    rounded to 7 decimals."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name, attr in vars(type(value)).items():
            if isinstance(attr, property):
                out[name] = _jsonable(getattr(value, name))
        return out
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 7)  # seconds to 0.1 µs
    return value


def to_json(results: Results) -> str:
    return json.dumps(_jsonable(results), indent=1) + "\n"


# ---------------------------------------------------------------------------- formatting


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:,.0f} ms"
    if ms >= 10:
        return f"{ms:.1f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def _ratio(value: float, base: float | None) -> str:
    if base is None or base == 0:
        return "-"
    r = value / base
    if 0 < r < 0.01:  # in-process and monty rows against a process per job
        return f"{r:.2g}x"
    return f"{r:,.0f}x" if r >= 100 else f"{r:.2f}x" if r < 10 else f"{r:.1f}x"


def _times(value: float, which: str = "") -> str:
    return f"{value:.2f}x" + (f" ({which})" if which else "")


def _cpu_per_job(runs: list[Throughput]) -> float | None:
    """The whole machine's CPU per job over ``runs`` together (None: not measured)."""
    if any(t.cpu_s is None for t in runs) or not sum(t.jobs for t in runs):
        return None
    return sum(t.cpu_s or 0.0 for t in runs) / sum(t.jobs for t in runs)


def _mib(kb: float) -> str:
    return f"{kb / MIB_KB:.1f} MiB"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """``align``: one of ``l``/``r`` per column."""
    marks = ["---" if a == "l" else "---:" for a in align]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(marks) + "|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
    ]


class Report:
    def __init__(self, results: Results) -> None:
        self.r = results
        self.s = results.settings

    def _missing(self, key: str) -> str:
        """Why ``key`` has no figure: its own error, else its daemon's failure to start."""
        if key in self.r.skipped:
            return f"skipped: {self.r.skipped[key]}"
        for k in (key, f"{key.split('/')[0]}/start"):
            if k in self.r.errors:
                return f"not measured (`{k}` failed, see Errors)"
        return "not measured"

    # ------------------------------------------------------------------ sections

    def render(self) -> str:
        sections: list[Callable[[], list[str]]] = [
            self._intro, self._machine, self._floors, self._targets, self._latency,
            self._throughput, self._cpu, self._levers,
            self._tool_calls, self._memory, self._sleep, self._deadlines, self._fairness,
            self._stages, self._transports, self._snapshots, self._redaction, self._profile,
            self._errors,
            self._method,
        ]
        lines: list[str] = []
        for section in sections:
            lines += [*section(), ""]
        return "\n".join(lines).rstrip() + "\n"

    def _intro(self) -> list[str]:
        lines = [
            "# jaild benchmark",
            "",
            f"One run of `{self.s.command}`, {self.r.machine['date']}: every figure below was "
            "measured in that run, on the machine described, and every ratio is against an "
            "alternative measured in the same run.",
        ]
        if self.s.quick:
            lines += ["", "**Quick (smoke) run**: few samples, short runs; figures are rough."]
        if not self.s.pool_section:
            lines += [
                "",
                "**`--no-pool-section`**: the policies carry no `[pool]` section, so every jaild "
                "variant below runs with the daemon's default way of making jails (for a daemon "
                "that predates `[pool]`: a full nsjail per job).",
            ]
        return lines

    def _machine(self) -> list[str]:
        rows = [[k, v] for k, v in self.r.machine.items()]
        return ["## Machine", "", *_table(["", ""], rows, "ll")]

    def _floors(self) -> list[str]:
        f = self.r.floors
        rows = []
        for key, label in FLOORS.items():
            x = f.get(key)
            if x is None:
                rows.append([label, self._missing(f"floors/{key}"), "", ""])
                continue
            rows.append([label + (f" ({x.note})" if x.note else ""), _us(x.median_s),
                         _us(x.p99_s), str(len(x.samples_s))])
        lines = ["## This machine's floors", "",
                 "What any design with jaild's hops pays on this machine before doing anything "
                 "of its own (`bench/floors.py`; nothing of jaild runs in the first four rows).",
                 "", *_table(["what", "p50", "p99", "runs"], rows, "lrrr")]
        same, apart = f.get("pingpong_same"), f.get("pingpong_apart")
        hot, idle = f.get("decode_hot"), f.get("decode_idle")
        notes = []
        if same and apart:
            notes.append(f"- A wake-up across CPUs costs {_ratio(apart.median_s, same.median_s)} "
                         "a round trip on one CPU: a tool call (four hops) pays it four times "
                         "when the processes sit on different CPUs.")
        if hot and idle:
            notes.append(f"- After {self.s.warm_pause_s * 1e3:.0f} ms idle, the same Python "
                         f"runs {_ratio(idle.median_s, hot.median_s)} slower: every paced warm "
                         "job pays that on all the code it runs, in three processes.")
        return lines + (["", *notes] if notes else [])

    def _target(
        self, name: str, value: float | None, met: Callable[[float], bool],
        shown: Callable[[float], str], source: str,
    ) -> list[str]:
        if value is None:
            return [name, self._missing(source), "-"]
        return [name, shown(value), "**met**" if met(value) else "not met"]

    def _targets(self) -> list[str]:
        r = self.r
        warm, cold = r.latency.get("warm"), r.latency.get("cold")
        best = max(
            ((t.jobs_per_s, f"{k}, {t.concurrency} clients") for k in ("cold", "warm")
             for t in r.throughput.get(k, [])),
            default=None,
        )
        tools = r.tool_calls.get("warm")
        idle = r.memory.get("cold")
        pool = r.memory.get("pool")
        sleep = r.sleep
        deadlines = r.deadlines
        t = self._target
        blocking = r.latency.get("warm_blocking")
        window = self.s.tool_window
        rows = [
            t("warm job latency p50 ≤ 1.0 ms (`AsyncClient`)", warm.median_s if warm else None,
              lambda v: v <= 0.001, _ms, "warm/latency"),
            t("warm job latency p99 ≤ 4 ms (`AsyncClient`)", warm.p99_s if warm else None,
              lambda v: v <= 0.004, _ms, "warm/latency"),
            t("warm job latency p50 ≤ 1.3 ms (blocking `Client`)",
              blocking.median_s if blocking else None, lambda v: v <= 0.0013, _ms,
              "warm_blocking/latency"),
            t("cold job latency p50 ≤ 5 ms", cold.median_s if cold else None,
              lambda v: v <= 0.005, _ms, "cold/latency"),
            t("≥ 300 fresh-jail jobs/s (best of jaild cold and warm)", best[0] if best else None,
              lambda v: v >= 300, lambda v: f"{v:,.0f} jobs/s ({best[1] if best else ''})",
              "cold/throughput/1"),
            t("tool-call round trip p50 ≤ 120 µs (jaild warm)", tools.median_s if tools else None,
              lambda v: v <= 120e-6, _us, "warm/tool_calls"),
            t("≥ 8,000 sequential tool calls/s in one job (jaild warm)",
              tools.sequential_per_s if tools else None, lambda v: v >= 8000,
              lambda v: f"{v:,.0f} calls/s", "warm/tool_calls"),
            t(f"≥ 20,000 tool calls/s with {window} in flight (jaild warm)",
              tools.windowed_per_s if tools else None, lambda v: v >= 20000,
              lambda v: f"{v:,.0f} calls/s", "warm/tool_calls"),
            t("daemon idle RSS ≤ 50 MiB (zygote mode, pool 0)",
              idle.daemon.rss_kb if idle else None, lambda v: v <= 50 * MIB_KB, _mib,
              "cold/memory"),
            t(f"pooled jail ≤ 15 MiB PSS (pool of {self.s.pool_size})",
              pool.pss_per_pooled_jail_kb if pool else None, lambda v: v <= 15 * MIB_KB, _mib,
              "pool/memory" if pool is None else "pool/jails"),
            t("500 concurrent 1 s jobs, zero failures", sleep.failures if sleep else None,
              lambda v: v == 0 and sleep is not None and sleep.jobs >= 500,
              lambda v: f"{sleep.jobs if sleep else 0} jobs, {v:.0f} failed, "
              f"{sleep.wall_s if sleep else 0:.1f} s wall",
              "cold/sleep"),
            t("wall-clock deadlines kept to ~100 ms: overshoot p99 ≤ 100 ms (jaild cold)",
              deadlines.p99_s if deadlines else None, lambda v: v <= 0.100, _ms,
              "cold/deadlines"),
        ]
        rows += self._cpu_targets()
        met = sum(row[2] == "**met**" for row in rows)
        return [
            "## Targets",
            "",
            f"{met} of {len(rows)} met.",
            "",
            *_table(["target", "measured", "verdict"], rows, "lrl"),
        ]

    def _latency(self) -> list[str]:
        lat = self.r.latency
        bases = {k: lat[k].median_s if k in lat else None for k in ("nsjail", "bwrap", "pyodide")}
        rows = []
        for key in ("exec", "python", "nsjail", "bwrap", "pyodide", *PEER_LATENCY, "spawn",
                    "cold", "warm", "warm_blocking", "warm_uvloop", "warm_uvloop_blocking",
                    "warm_traced", "warm_pinned"):
            label = self.r.labels[key]
            if key not in lat:
                rows.append([label, self._missing(f"{key}/latency"), "", "", "", "", ""])
                continue
            x = lat[key]
            rows.append([
                label + (f" ({x.note})" if x.note else ""), _ms(x.median_s), _ms(x.p99_s),
                str(len(x.samples_s)), *(_ratio(x.median_s, b) for b in bases.values()),
            ])
        return [
            "## 1. Job latency",
            "",
            "Trivial code (`result = 1 + 1`), sequential jobs, from the call to the result in "
            "hand. Ratios are of medians. jaild rows use `AsyncClient`, except the blocking "
            "`Client` rows, whose calls hop to its event-loop thread and back. jaild's daemon "
            "and client run on the standard `asyncio` loop (the default); the uvloop rows run "
            "both on uvloop (`daemon.event_loop`, `jaild.loops`), in the same run; the "
            "one-CPU row runs the daemon (and so its zygote and jails) and the client on the "
            "first CPU only (`taskset`, `sched_setaffinity`).",
            "",
            *_table(["what", "median", "p99", "runs", "x bare nsjail", "x bubblewrap",
                     "x Pyodide"], rows, "lrrrrrr"),
            "",
            *self._tracing(),
            "The peers: pydantic-monty runs the code (`result = 1 + 1` then `result`, its "
            "last expression being the result) in a `monty` worker subprocess of its pool: warm "
            "= one pool started beforehand, a checkout (a new session on the same worker) per "
            "job; cold = a new pool, so a new worker process, per job. llm-sandbox starts a new "
            "`bwrap` or `nsjail` and the jail environment's python for every `run`, reading "
            "the result from stdout; a session per job adds the session's set-up (a host "
            "temporary directory and one sandboxed `/bin/true`) and its removal; sessions "
            "skip the per-session venv it makes by default (`skip_environment_setup`).",
            "",
            *self._isolation(),
        ]

    def _tracing(self) -> list[str]:
        """What tracing costs a warm job: the traced rows against the warm ones."""
        lat, calls = self.r.latency, self.r.tool_calls
        if "warm_traced" not in lat or "warm" not in lat:
            return [f"Tracing on: {self._missing('warm_traced/latency')}.", ""]
        on, off = lat["warm_traced"], lat["warm"]
        text = (
            f"Tracing on (`OTEL_TRACES_EXPORTER=otlp`, the SDK's batching as it comes, to an "
            f"OTLP/HTTP sink on loopback in the bench's process): a warm job's median "
            f"{_ms(on.median_s)}, {_ratio(on.median_s, off.median_s)} of the warm row's, p99 "
            f"{_ratio(on.p99_s, off.p99_s)}"
        )
        if "warm_traced" in calls and "warm" in calls:
            text += (f"; a tool call's round trip (p50, section 3) "
                     f"{_ratio(calls['warm_traced'].median_s, calls['warm'].median_s)} (a call "
                     "notes its end; its span is made with the job's, after the record is sent)")
        t = self.r.tracing
        if t:
            text += (f". The sink got {t.get('jaild.job', 0):,} job spans and "
                     f"{t.get('jaild.tool_call', 0):,} tool-call spans in "
                     f"{t.get('export_requests', 0):,} requests "
                     f"({t.get('exported_bytes', 0) / 1024:,.0f} KiB)")
        return [text + ". Tracing off (the default), the job's path only tests whether it is "
                "on (docs/using/tracing.md).", ""]

    def _isolation(self) -> list[str]:
        iso = self.r.isolation
        rows = [[label, iso[kind]] for kind, label in ISOLATION_ROWS.items() if kind in iso]
        lines = ["### What each row isolates", "", *_table(["rows", "isolation"], rows, "ll")]
        evidence = [f"- {ISOLATION_ROWS.get(k, k)}: {v}" for k, v in self.r.evidence.items()]
        missing = [f"- {ISOLATION_ROWS.get(k, k)}: {self._missing(f'{k}/evidence')}"
                   for k in ("monty", "llm_bwrap", "llm_nsjail") if k not in self.r.evidence]
        if evidence or missing:
            lines += ["", "Read in this run (the argv llm-sandbox builds, long arguments cut; "
                      "each sandboxed process's `/proc/self/status` and namespaces, monty's "
                      "worker's read from the host while a job waited on an external call):",
                      "", *evidence, *missing]
        return lines

    def _throughput(self) -> list[str]:
        base = {t.concurrency: t.jobs_per_s for t in self.r.throughput.get("nsjail", [])}
        base_cpu = {t.concurrency: t.cpu_per_job_s for t in self.r.throughput.get("nsjail", [])}
        rates, latencies, cpus, notes = [], [], [], []
        for key in ("nsjail", "bwrap", "spawn", "cold", "warm"):
            runs = {t.concurrency: t for t in self.r.throughput.get(key, [])}
            label = self.r.labels[key]
            rate, latency, used = [label], [label], [label]
            for level in self.s.levels:
                t = runs.get(level)
                if t is None:
                    missing = key == "bwrap" and level not in (16, 64)
                    rate.append("-" if missing else self._missing(f"{key}/throughput/{level}"))
                    latency.append("")
                    used.append("")
                    continue
                ratio = "" if key == "nsjail" else f" ({_ratio(t.jobs_per_s, base.get(level))})"
                rate.append(f"{t.jobs_per_s:,.0f}{ratio}")
                latency.append(f"{_ms(t.median_s)} / {_ms(t.p99_s)}")
                per_job = t.cpu_per_job_s
                if per_job is None:
                    used.append("")
                else:
                    ratio = "" if key == "nsjail" else (
                        f" ({_ratio(per_job, base_cpu.get(level))})")
                    used.append(f"{per_job * 1e3:.1f} ms{ratio}")
                if t.failures:
                    notes.append(f"- {label}, {level} concurrent: {t.failures} of {t.jobs} jobs "
                                 f"failed; first: {t.first_failure}")
            rates.append(rate)
            latencies.append(latency)
            cpus.append(used)
        levels = [f"{n} client{'s' if n > 1 else ''}" for n in self.s.levels]
        align = "l" + "r" * len(levels)
        return [
            "## 2. Fresh-jail jobs per second, flat out",
            "",
            f"Trivial jobs back to back from each of N concurrent clients for "
            f"{self.s.seconds_per_level:g} s (jobs in flight at the deadline finish and count; "
            "failed jobs do not). jaild: N coroutines on one `AsyncClient` connection; bare "
            "nsjail: N threads each running `nsjail … python3` per job. In brackets: x bare "
            "nsjail at the same N.",
            "",
            *_table(["jobs/s", *levels], rates, align),
            "",
            "Each job's latency in those runs, call to result (median / p99):",
            "",
            *_table(["latency under load", *levels], latencies, align),
            "",
            "CPU per job in those runs, for the whole machine (`/proc/stat`: every process and "
            "kernel thread, the bench's client included; not idle, iowait or steal), divided "
            "by the jobs finished; in brackets x bare nsjail's at the same N:",
            "",
            *_table(["CPU per job", *levels], cpus, align),
            *(["", *notes] if notes else []),
        ]

    def _cpu(self) -> list[str]:
        r = self.r
        keys = ["nsjail", "cold", "warm"]
        cols = [r.labels[k] for k in keys]
        rows = []
        for category in BREAKDOWN_ROWS:
            row, shown = [category], False
            for key in keys:
                b = r.breakdown.get(key)
                if b is None:
                    row.append("")
                    continue
                user, kernel = b.per_job_ms(category)
                shown = shown or user + kernel >= 0.005
                row.append(f"{user + kernel:.2f} ({user:.2f} / {kernel:.2f})"
                           if user + kernel >= 0.005 else "")
            if shown:
                rows.append(row)
        rows.append(["**all**", *(f"**{r.breakdown[k].busy_per_job_ms:.2f}**"
                                  if k in r.breakdown else self._missing(f"{k}/breakdown")
                                  for k in keys)])
        rows.append(["jobs in the run", *(f"{r.breakdown[k].jobs:,}" if k in r.breakdown
                                          else "" for k in keys)])
        if not r.breakdown:  # perf missing (the reason, once) or every recording failed
            why = [self._missing(f"{k}/breakdown") for k in keys]
            rows = [["all", why[0], *([""] * (len(keys) - 1) if len(set(why)) == 1 else why[1:])]]
        lines = [
            "## 10. CPU per fresh jail, and where it goes",
            "",
            f"One flat-out run of {BREAKDOWN_CLIENTS} clients per column, recorded with `perf "
            "record -a` at 997 Hz; each sample put to who ran it (a jail: anything a zygote "
            "forked) and to user or kernel mode. Milliseconds of CPU per job: all (user / "
            "kernel). Section 2 has the same per-job CPU from `/proc/stat` at each N.",
            "",
            *_table(["ms of CPU per job", *cols], rows, "l" + "r" * len(cols)),
        ]
        f = r.stage_floors
        fork = f.get("fork_exit")
        stage_rows = []
        for key, label in STAGES.items():
            cost = f.get(key)
            if cost is None and key in V2_ONLY and "cgroup" in f:
                stage_rows.append([label, "— (cgroup v1 here)", ""])
                continue
            if cost is None:
                stage_rows.append([label, self._missing(f"stages/{key}"), ""])
                continue
            alone = "" if key in ("fork_exit", "cow") or fork is None else (
                f"{(cost - fork) * 1e3:.2f} ms")
            cell = f"{cost * 1e6:.1f} µs" if key == "cow" else f"{cost * 1e3:.2f} ms"
            stage_rows.append([label, cell, alone])
        lines += [
            "",
            "What the kernel charges for each stage of a fresh jail, made by a helper process "
            "the size of a zygote (`bench/floors.py`): CPU per operation for the whole "
            "machine, kernel threads' deferred work included, the median of 3 runs (one in a "
            "quick run). The last "
            "column is the stage alone (less the fork and exit).",
            "",
            *_table(["stage", "CPU", "the stage alone"], stage_rows, "lrr"),
        ]
        floor = self._kernel_floor()
        if fork is None or floor is None:
            return lines
        kernel = floor - (r.jail_pages or 0) * f["cow"]
        whole = kernel - f["seccomp_split"] + f["seccomp"]
        notes = [f"- A fresh jail's kernel floor -- a fork and an exit, a fresh namespace set, "
                 f"its cgroups, its part of its policy's seccomp filters (its zygote loaded "
                 f"the rest once): **{kernel * 1e3:.2f} ms** of CPU ({whole * 1e3:.2f} ms with "
                 "the filters loaded whole by each jail, as before)."]
        if r.jail_pages is not None:
            cow = r.jail_pages * f["cow"]
            kernel += cow
            notes.append(
                f"- A trivial job's jail has copied {r.jail_pages:,} pages of its zygote by its "
                f"code's last line (its minor faults): {cow * 1e3:.2f} ms at "
                f"{f['cow'] * 1e6:.1f} µs a page. With the floor above: **{kernel * 1e3:.2f} "
                "ms** before any Python does its own work.")
        for key in ("cold", "warm"):
            b = r.breakdown.get(key)
            if b is not None:
                notes.append(f"- {r.labels[key]}: {b.busy_per_job_ms:.2f} ms a job here, "
                             f"{_ratio(b.busy_per_job_ms, kernel * 1e3)} that floor.")
        return [*lines, "", *notes]

    def _kernel_floor(self) -> float | None:
        """Section 10's floor, seconds of CPU: what the kernel charges a fresh jail as jaild
        makes it by default (its part of the split seccomp filters; on v2 forked straight
        into its cgroup) plus the pages a trivial job's jail copies; None if a stage is
        missing."""
        f = self.r.stage_floors
        if not all(k in f for k in ("fork_exit", "namespaces", "cgroup", "seccomp_split", "cow")):
            return None
        fork = f["fork_exit"]
        cgroup = f.get("cgroup_clone3", f["cgroup"])  # v2: forked straight into it
        return (f["namespaces"] + (cgroup - fork) + (f["seccomp_split"] - fork)
                + (self.r.jail_pages or 0) * f["cow"])

    def _levers(self) -> list[str]:
        r = self.r
        rows = []
        for key, label in LEVERS.items():
            runs = r.levers.get(key)
            if not runs and key == "clone3" and not os.path.exists(
                    "/sys/fs/cgroup/cgroup.controllers"):
                rows.append([label, "cgroup v1 here: measured in the v2 guest "
                             "(docs/performance.md)", "", "", "", ""])
                continue
            if not runs or not runs.get("on") or not runs.get("off"):
                rows.append([label, self._missing(f"levers/{key}"), "", "", "", ""])
                continue
            on, off = runs["on"], runs["off"]
            rate_on = sum(t.jobs for t in on) / sum(t.seconds for t in on)
            rate_off = sum(t.jobs for t in off) / sum(t.seconds for t in off)
            cpu_on = _cpu_per_job(on)
            cpu_off = _cpu_per_job(off)
            rows.append([
                label, f"{rate_off:,.0f}", f"{rate_on:,.0f}", _ratio(rate_on, rate_off),
                f"{cpu_off * 1e3:.2f} / {cpu_on * 1e3:.2f} ms" if cpu_on and cpu_off else "",
                _ratio(cpu_on, cpu_off) if cpu_on and cpu_off else "",
            ])
        b = r.breakdown.get("warm")
        daemon = f"{b.per_job_ms('daemon')[0] + b.per_job_ms('daemon')[1]:.2f} ms" if b else (
            self._missing("warm/breakdown"))
        pages = f"{r.jail_pages:,}" if r.jail_pages is not None else self._missing(
            "cold/jail_pages")
        shown = [f"a trivial job's jail copied {pages} pages of its zygote (860 there, "
                 "section 10)", f"the daemon's CPU per warm job, flat out, {daemon} (2.5 ms "
                 "there, section 10)"]
        return [
            "## 13. Each lever of a fresh jail, on its own",
            "",
            f"jaild warm (zygote, pool 4-8) flat out at {BREAKDOWN_CLIENTS} clients with one "
            "lever off and on, two daemons taking turns (off, on, three times -- once each in "
            f"a quick run; {self.s.seconds_per_level:g} s a turn), everything else alike. "
            "Jobs/s and the whole machine's CPU per job (`/proc/stat`) over all turns of each "
            "side. This VM's speed drifts by up to a tenth between minutes, so a lever worth "
            "less than that may read either way here; its own figure is on its stage (section "
            "10) or in `bench/pages.py`, `bench/daemon_cpu.py`, `bench/shared_netns.py`.",
            "",
            *_table(["lever", "jobs/s off", "jobs/s on", "on / off", "CPU per job off / on",
                     "on / off"], rows, "lrrrrr"),
            "",
            f"The first row's off side is {self.s.levers_base}'s daemon, jails and runtime, "
            "started from a worktree of it as `make bench-ab` starts its base.",
            "",
            "Levers without a switch, this run beside the run issue 45 quotes (772636e): "
            + "; ".join(shown) + ".",
        ]

    def _cpu_targets(self) -> list[list[str]]:
        """The fresh jail's cost, as ratios to rows of the same run."""
        r, t = self.r, self._target
        nsjail = {x.concurrency: x for x in r.throughput.get("nsjail", [])}
        rows = []
        for level in CPU_LEVELS:
            base = nsjail.get(level)
            fastest = max(((x.jobs_per_s / base.jobs_per_s, k) for k in ("cold", "warm")
                           for x in r.throughput.get(k, [])
                           if base is not None and x.concurrency == level), default=None)
            rows.append(t(
                f"fresh-jail jobs/s ≥ 3x bare nsjail's, {level} clients (best of cold, warm; "
                "aim 4x)",
                fastest[0] if fastest else None, lambda v: v >= 3,
                functools.partial(_times, which=fastest[1] if fastest else ""),
                f"cold/throughput/{level}"))
            base_cpu = base.cpu_per_job_s if base is not None else None
            least = min(((per_job / base_cpu, k) for k in ("cold", "warm")
                         for x in r.throughput.get(k, [])
                         if x.concurrency == level and (per_job := x.cpu_per_job_s)
                         and base_cpu), default=None)
            rows.append(t(
                f"CPU per fresh jail ≤ 1/3 of bare nsjail's, {level} clients (least of cold, "
                "warm; aim 1/4)", least[0] if least else None, lambda v: v <= 1 / 3,
                functools.partial(_times, which=least[1] if least else ""),
                f"cold/throughput/{level}"))
        warm, cold, bare = r.latency.get("warm"), r.latency.get("cold"), r.latency.get("nsjail")
        shape, tool_shape = r.floors.get("shape"), r.floors.get("tool_shape")
        tools = r.tool_calls.get("warm")
        floor = self._kernel_floor()
        warm_b = r.breakdown.get("warm")
        warm_cpu = warm_b.busy_per_job_ms / 1e3 if warm_b else None
        return [
            *rows,
            t("warm job p50 ≤ 3x the four-hop floor (`shape`, paced alike)",
              warm.median_s / shape.median_s if warm and shape else None, lambda v: v <= 3,
              lambda v: f"{v:.2f}x", "floors/shape" if warm else "warm/latency"),
            t("tool-call p50 ≤ 2x the four-hop tool-call floor (`tool_shape`; aim 1.5x)",
              tools.median_s / tool_shape.median_s if tools and tool_shape else None,
              lambda v: v <= 2, lambda v: f"{v:.2f}x",
              "floors/tool_shape" if tools else "warm/tool_calls"),
            t("a warm job's CPU ≤ 1.25x the kernel floor (section 10, flat out; aim 1.1x)",
              warm_cpu / floor if warm_cpu and floor else None, lambda v: v <= 1.25,
              lambda v: f"{v:.2f}x", "warm/breakdown" if floor else "stages"),
            t("cold job p50 ≤ 0.3x bare nsjail's",
              cold.median_s / bare.median_s if cold and bare else None, lambda v: v <= 0.3,
              lambda v: f"{v:.2f}x", "nsjail/latency" if cold else "cold/latency"),
        ]

    def _tool_calls(self) -> list[str]:
        floor = self.r.tool_calls.get("floor")
        warm = self.r.tool_calls.get("warm")
        rows = []
        for key in ("floor", "monty", "llm", "spawn", "cold", "warm", "warm_uvloop",
                    "warm_traced", "warm_pinned"):
            t = self.r.tool_calls.get(key)
            if t is None:
                rows.append([self.r.labels[key], self._missing(f"{key}/tool_calls"),
                             "", "", "", "", ""])
                continue
            rows.append([
                self.r.labels[key], _us(t.median_s), _us(t.p99_s),
                f"{t.sequential_per_s:,.0f}", f"{t.windowed_per_s:,.0f}",
                _ratio(t.median_s, floor.median_s if floor else None),
                _ratio(t.median_s, warm.median_s if warm else None),
            ])
        return [
            "## 3. Tool-call round trip",
            "",
            f"jaild: one job makes {self.s.tool_calls:,} sequential `await tools.echo(i)` calls, "
            "each timed inside the jail with `time.perf_counter()` (jail → daemon → client's "
            "async handler → daemon → jail), then "
            f"{self.s.tool_calls:,} calls through `asyncio.gather` with at most "
            f"{self.s.tool_window} in flight. Floor: the same number of msgpack frames shaped "
            "like a tool call, echoed by an asyncio server over a Unix socket in one process. "
            "pydantic-monty: the same job in its subset, `await echo(i)` calling a coroutine "
            "on `AsyncMonty`'s event loop (worker → pool → handler → pool → worker), timed "
            "inside the sandbox; its `asyncio` has no `Semaphore`, so the windowed calls go as "
            f"`gather`s of {self.s.tool_window}, one after another.",
            "",
            *_table(["what", "p50", "p99", "sequential calls/s",
                     f"calls/s, {self.s.tool_window} in flight", "x floor (p50)",
                     "x jaild warm (p50)"], rows, "lrrrrrr"),
        ]

    def _memory(self) -> list[str]:
        rows = []
        details = []
        for key in ("spawn", "cold", "warm", "pool"):
            m = self.r.memory.get(key)
            label = self.r.labels[key]
            if m is None:
                rows.append([label, self._missing(f"{key}/memory"), "", "", "", "", ""])
                continue
            zygote = (
                ", ".join(f"{_mib(z.pss_kb)} / {_mib(z.rss_kb)}" for z in m.zygotes)
                if m.zygotes else "none found"
            )
            per_jail = m.pss_per_pooled_jail_kb
            others = sum(o.pss_kb for o in m.others)
            rows.append([
                label, _mib(m.daemon.rss_kb), _mib(m.daemon.pss_kb), zygote,
                str(len(m.pooled_jails)), "-" if per_jail is None else _mib(per_jail),
                f"{len(m.others)}: {_mib(others)}" if m.others else "0",
            ])
            if m.others:
                names = sorted({o.name for o in m.others})
                details.append(f"- {label}: other descendants are {', '.join(names)}")
        return [
            "## 4. Memory",
            "",
            "Read from `/proc` once the daemon is idle (for pooled variants: once the pool has "
            "filled, or after a timeout). The zygote is the topmost descendant of the daemon, "
            "other than nsjail and setpriv, with `zygote` in its command line; each child of it "
            "is one pooled jail, whose PSS sums its subtree (`/proc/PID/smaps_rollup`). Other "
            "descendants (nsjail, setpriv, ...) are counted apart.",
            "",
            *_table(["daemon", "daemon RSS", "daemon PSS", "zygote PSS / RSS", "pooled jails",
                     "PSS per pooled jail", "other descendants (PSS)"], rows, "lrrrrrr"),
            *(["", *details] if details else []),
        ]

    def _sleep(self) -> list[str]:
        s = self.r.sleep
        head = ["## 5. Concurrent sleeping jobs", ""]
        if s is None:
            return [*head, self._missing("cold/sleep")]
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(s.statuses.items()))
        lines = [
            *head,
            f"{s.jobs} jobs (`import time; time.sleep(1); result = 1`) submitted at once over "
            f"{s.clients} client connections to the {self.r.labels['cold']} daemon, whose config "
            "allows 1,024 jobs at once and 512 per connection.",
            "",
            f"- wall time, first submit to last result: {s.wall_s:.2f} s",
            f"- each job, burst start to its result: median {_ms(s.median_s)}, p99 {_ms(s.p99_s)}",
            f"- failures: {s.failures} ({statuses})",
        ]
        if s.first_failure:
            lines.append(f"- first failure: {s.first_failure}")
        return lines

    def _deadlines(self) -> list[str]:
        d = self.r.deadlines
        head = ["## 6. Wall-clock deadlines", ""]
        if d is None:
            return [*head, self._missing("cold/deadlines")]
        return [
            *head,
            f"{len(d.samples_s)} jobs (`import time; time.sleep(60)`) run one after another on "
            f"the {self.r.labels['cold']} daemon with a {d.limit_s:g} s wall-clock limit, each "
            "ended by the daemon's deadline. Overshoot: the record's `usage.wall_s` (the "
            "daemon's clock, from the code's start to the jail's end) minus the limit.",
            "",
            f"- overshoot: median {_ms(d.median_s)}, p99 {_ms(d.p99_s)}, "
            f"max {_ms(max(d.samples_s))}",
        ]

    def _fairness(self) -> list[str]:
        f, s = self.r.fairness, self.s
        idle = f.get("idle")
        phases = {
            "idle": "idle: uid 0 runs nothing",
            "sleep_flood": f"uid 0 holds its share, {s.fairness_share} jobs sleeping",
            "cpu_flood": f"uid 0 holds its share, {s.fairness_share} jobs spinning "
                         "(`while True: pass`)",
        }
        rows = []
        for key, label in phases.items():
            x = f.get(key)
            if x is None:
                rows.append([label, self._missing(f"fairness/{key}"), "", "", "", ""])
                continue
            rows.append([
                label + (f" ({x.note})" if x.note else ""), _ms(x.median_s), _ms(x.p99_s),
                str(len(x.samples_s)),
                _ratio(x.median_s, idle.median_s if idle else None),
                _ratio(x.p99_s, idle.p99_s if idle else None),
            ])
        lines = [
            "## 7. Fairness between uids",
            "",
            f"One private daemon (`{self.r.labels['fairness']}`, `max_jobs = "
            f"{2 * s.fairness_share}`, so each uid's share is {s.fairness_share}), its socket "
            "reachable by group `nogroup`. uid 65534 runs trivial warm jobs one after another "
            f"({s.warm_pause_s * 1e3:.0f} ms pause before each, 2 untimed first) with the client "
            "library as that uid, in three phases of one run: uid 0 idle; uid 0 holding its "
            "whole share with jobs that sleep; uid 0 holding it with jobs that spin on the CPU "
            "(no `limits.cpu_cores`). Each flood is checked to stop at the share (the next job "
            "is refused `busy`) and is cancelled after its phase; in brackets, the CPU uid 0's "
            "jobs used together (their CPU seconds over their wall time, from their records).",
            "",
            *_table(["uid 65534's jobs while", "median", "p99", "runs", "x idle (median)",
                     "x idle (p99)"], rows, "lrrrrr"),
        ]
        sleep, cpu = f.get("sleep_flood"), f.get("cpu_flood")
        if idle and sleep and cpu:
            lines += [
                "",
                f"Against idle, the sleeping flood put the other uid's median at "
                f"{_ratio(sleep.median_s, idle.median_s)} and its p99 at "
                f"{_ratio(sleep.p99_s, idle.p99_s)}: held jails take slots, which the share "
                "bounds, and (in brackets) next to no CPU. The spinning flood put them at "
                f"{_ratio(cpu.median_s, idle.median_s)} and {_ratio(cpu.p99_s, idle.p99_s)}, "
                f"its jobs using the CPU in brackets of {self.r.machine.get('cores', '?')} "
                "cores shared with everything else on the machine (the load average is under "
                "Machine): the share bounds jails, not CPU "
                "time, which the security model (docs/security.md) lists as not protected "
                "between tenants (`limits.cpu_cores` caps one job).",
            ]
        return lines

    def _stages(self) -> list[str]:
        st = self.r.stages
        head = ["## 8. Where a warm job's time goes", ""]
        if not st:
            return [*head, self._missing("warm/stages")]
        rows = [[stage, _us(statistics.median(v)), _us(percentile(v, 90))]
                for stage, v in st.items() if v]
        total = [sum(parts) for parts in zip(*st.values(), strict=False)]
        rows.append(["**call to result**", _us(statistics.median(total)),
                     _us(percentile(total, 90))])
        return [
            *head,
            f"{len(total)} paced warm jobs (`AsyncClient`, {self.s.warm_pause_s * 1e3:.0f} ms "
            "apart) against a daemon whose functions on the job's path note "
            "`time.perf_counter_ns()` (the host's monotonic clock, one for every process), "
            "with the same notes in the client (`bench/stages.py`): each stage's median and "
            "p90. Before issue 15 the README put a ~2.4 ms warm job at: client to daemon and "
            "admission ~0.7 ms, the code handed over ~0.2 ms, the jail's decode and run "
            "~0.7 ms, the result back ~0.3 ms, the record to the client ~0.5 ms.",
            "",
            *_table(["stage", "p50", "p90"], rows, "lrr"),
            "",
            "client send: `run()` called -> the daemon has read `RunJob` (encode, one socket "
            "hop, the daemon's wake-up and decode); admit + place: `RunJob` -> the pooled "
            "jail's `RunCode` written; jail: `RunCode` written -> `CodeFinished` read (two "
            "hops, the jail's decode, run, look at `/tmp` and reply); record: `CodeFinished` "
            "-> `JobFinished` written (evidence, usage, the record, audit, accounting, "
            "metrics); to client: one hop and the client's decode; client return: the "
            "decoded record -> `run()` returns.",
        ]

    def _transports(self) -> list[str]:
        lat, calls, s = self.r.latency, self.r.tool_calls, self.s
        rows = []
        for key, base, same in (
            ("transport_unix", None, "transport_unix_liveness_off"),
            ("transport_tls", "transport_unix", "transport_tls_liveness_off"),
            ("transport_unix_liveness_off", None, None),
            ("transport_tls_liveness_off", "transport_unix_liveness_off", None),
        ):
            x = lat.get(key)
            if x is None:
                rows.append([self.r.labels[key], self._missing("transport/latency"),
                             "", "", "", ""])
                continue
            unix = lat.get(base) if base else None
            off = lat.get(same) if same else None
            rows.append([
                self.r.labels[key], _ms(x.median_s), _ms(x.p99_s), str(len(x.samples_s)),
                _ratio(x.median_s, unix.median_s) if unix else "-",
                _ratio(x.median_s, off.median_s) if off else "-",
            ])
        tool_rows = []
        for key in ("transport_unix", "transport_tls"):
            t = calls.get(key)
            if t is None:
                tool_rows.append([self.r.labels[key], self._missing("transport/tool_calls"),
                                  "", "", "", ""])
                continue
            unix_calls = calls.get("transport_unix")
            tool_rows.append([
                self.r.labels[key], _us(t.median_s), _us(t.p99_s),
                f"{t.sequential_per_s:,.0f}", f"{t.windowed_per_s:,.0f}",
                _ratio(t.median_s, unix_calls.median_s)
                if unix_calls and key != "transport_unix" else "-",
            ])
        lines = [
            "## 9. Over mutual TLS, and what liveness costs",
            "",
            "Two private daemons like the warm row's (zygote, pool 4-8), each listening on its "
            "Unix socket and on mutual TLS on loopback (`daemon.listen = "
            "[\"tls://127.0.0.1:0\"]`: TLS 1.3, the client's certificate verified against a "
            "throwaway CA, `bench/certs.py`). The first has liveness at its default at both "
            "ends (`limits.liveness_timeout_s` and the client's `liveness_timeout_s`, "
            f"{LIVENESS_DEFAULT_S:g} s); "
            "the second is the same with liveness off at both ends (0). One `AsyncClient` per "
            "row, all connected (handshakes done) before the first timed job, take turns job "
            "by job (in an order shuffled each round), each job after a "
            f"{s.warm_pause_s * 1e3:.0f} ms pause, 2 rounds untimed first: a job's round trip "
            "on an open connection, the rows compared seeing the same moments of the machine. "
            "x Unix socket: against the row over the same daemon's Unix socket, so only the "
            "transport differs (the jail, the pool, the daemon's work are the same). "
            "x liveness off: against the same transport on the daemon with liveness off, so "
            "only liveness differs.",
            "",
            *_table(["what", "median", "p99", "runs", "x Unix socket (median)",
                     "x liveness off (median)"], rows, "lrrrrr"),
            "",
            f"The tool-call round trip over each transport of the first daemon: section 3's "
            f"job ({s.tool_calls:,} sequential `await tools.echo(i)` calls timed in the jail, "
            f"then {s.tool_calls:,} with at most {s.tool_window} in flight), the daemon's "
            "calls to the client and the client's answers going over the transport; one job "
            "over the Unix socket, two over TLS, one over the Unix socket again (each row is "
            "its two jobs together).",
            "",
            *_table(["what", "p50", "p99", "sequential calls/s",
                     f"calls/s, {s.tool_window} in flight", "x Unix socket (p50)"],
                    tool_rows, "lrrrrr"),
        ]
        return lines + self._transport_summary()

    def _snapshots(self) -> list[str]:
        lines = [
            "## 11. Sessions that outlive their jail: snapshot, restore, fork, pause",
            "",
            "A private daemon per kind of session, serving the shipped policy (default; data, "
            "with numpy and pandas) as it makes jails. The session is built once (small: 2,000 "
            "small dicts, a function, a class and its instance, the random generator seeded; "
            f"history: {HISTORY_RUNS} runs each adding one sum over 300,000 squares to a list; "
            "data: numpy and pandas imported, a 200x200 array, a 5,000-row frame and its "
            "`describe()`), then each round: `snapshot()`; opening a session from it "
            "(`restore`, until it is ready: a fresh jail made, the state unpickled in it); "
            "opening a fresh session (`fresh`: the least any restore pays) and running the "
            "code that built the state in it (`replay`: what the replay-journal mechanism "
            f"pays to restore); `fork({FORKS})`; `pause()`; the next run's resume (its time "
            "less a warm run's). Client to answer, medians over the rounds. E2B's published "
            f"figures (a microVM's whole memory: about {E2B_PAUSE_S_PER_GIB:g} s per GiB to "
            f"pause, about {E2B_RESUME_S:g} s to resume) stand beside ours as what a user of "
            "a peer meets; CRIU is not measured (`criu check` fails on this host's kernel: "
            "docs/performance.md).",
            "",
        ]
        rows = []
        for kind, label in (("small", "small session"),
                            ("history", f"small state, {HISTORY_RUNS} runs of history"),
                            ("data", "numpy + pandas session")):
            x = self.r.snapshots.get(kind)
            if x is None:
                rows.append([label, self._missing(f"snapshots/{kind}"), *[""] * 9])
                continue
            restore, fresh, replay = x.restore.median_s, x.fresh.median_s, x.replay.median_s
            rows.append([
                label, f"{x.bytes / 1024:,.0f} KiB", _ms(x.snapshot.median_s), _ms(restore),
                _ratio(restore, fresh), _ratio(restore, replay), _ms(x.fork.median_s),
                _ms(x.pause.median_s), _ms(x.resume.median_s),
                _ratio(restore, E2B_RESUME_S), str(len(x.restore.samples_s)),
            ])
        return lines + _table(
            ["session", "size", "snapshot", "restore", "x fresh open", "x replay",
             f"fork({FORKS})", "pause", "resume", "x E2B resume (1 s)", "rounds"],
            rows, "lrrrrrrrrrr")

    def _transport_summary(self) -> list[str]:
        """The section's ratios in a sentence, and what liveness does on a job's path."""
        lat, calls = self.r.latency, self.r.tool_calls
        unix, tls = lat.get("transport_unix"), lat.get("transport_tls")
        unix_off, tls_off = (lat.get("transport_unix_liveness_off"),
                             lat.get("transport_tls_liveness_off"))
        said = []
        if unix and tls:
            said.append(f"Over TLS a warm job's median was {_ratio(tls.median_s, unix.median_s)} "
                        f"the Unix socket's (p99 {_ratio(tls.p99_s, unix.p99_s)})")
            cu, ct = calls.get("transport_unix"), calls.get("transport_tls")
            if cu and ct:
                said[-1] += (f", a tool call's round trip {_ratio(ct.median_s, cu.median_s)} "
                             f"(p50; {_ratio(ct.windowed_per_s, cu.windowed_per_s)} the calls "
                             f"per second with {self.s.tool_window} in flight)")
        if unix and unix_off:
            said.append(f"liveness on put the warm job's median at "
                        f"{_ratio(unix.median_s, unix_off.median_s)} of liveness off over the "
                        "Unix socket"
                        + (f" and {_ratio(tls.median_s, tls_off.median_s)} over TLS"
                           if tls and tls_off else ""))
        if not said:
            return []
        idle_s = LIVENESS_DEFAULT_S / 3  # an end pings a peer idle this long
        text = ("; ".join(said) + ". Liveness changes nothing on a job's path: each end notes "
                "when it last read from the other either way; on, it also keeps one timer per "
                f"connection, which pings only a peer idle for a third of the bound "
                f"({idle_s:g} s).")
        rows = [lat[k].samples_s for k in TRANSPORT_ROWS if k in lat]
        if len(rows) == len(TRANSPORT_ROWS) and rows[0]:
            rounds = [sum(r) + len(rows) * self.s.warm_pause_s for r in zip(*rows, strict=True)]
            # a connection's longest wait between two of its jobs: at most two rounds
            longest = max((a + b for a, b in itertools.pairwise(rounds)), default=rounds[0])
            text += (f" Each connection here ran a job every {_ms(statistics.median(rounds))} "
                     f"(median; at most {_ms(longest)} apart)")
            text += (", never idle that long: the rows with liveness on sent no ping, and their "
                     "ratios to liveness off show how far two alike daemons' figures differ "
                     "in one run." if longest < idle_s else
                     ", idle long enough at times for a ping to be sent.")
        return ["", text]

    def _redaction(self) -> list[str]:
        head = ["## 12. Redaction", ""]
        if not self.r.redaction:
            return [*head, self._missing("redaction")]
        rows = [[x.what, f"{x.text_bytes:,} B", f"{x.old_s:.3f} s", f"{x.new_s:.3f} s",
                 f"{x.build_s:.3f} s", _ratio(x.old_s, x.new_s)] for x in self.r.redaction]
        return [
            *head,
            f"{self.r.redaction[0].secrets:,} secrets (the most a job keeps; multi-line, so each "
            "has escaped forms too), planted in the text plain and as JSON, in this process "
            "(`bench/redaction.py`): the sort per string that jaild 0.1 ran on the event loop "
            "(every secret, longest first, `str.replace` over each string) beside the one "
            "Aho-Corasick automaton that now runs in a worker thread (made once per run: its "
            "making is in its time, and shown alone).",
            "",
            *_table(["case", "text", "sort per string", "automaton", "of which making it",
                     "ratio"], rows, "lrrrrr"),
        ]

    def _profile(self) -> list[str]:
        head = ["## Where the time goes", ""]
        if not self.r.profiles:
            reason = (
                "; ".join(f"{k}: {v}" for k, v in self.r.errors.items() if "/profile" in k)
                or "this run was made without `--profile`"
            )
            return [
                *head,
                f"_No profile: {reason}._ Run `bench/compare.py --profile` (py-spy on the daemon "
                "and its Python descendants during the cold and warm latency runs) to fill this "
                "section.",
                "",
                "- cold path: _to be filled_",
                "- warm path: _to be filled_",
            ]
        lines = [
            *head,
            f"py-spy at {flames.RATE_HZ} Hz on the daemon and its Python descendants "
            "(`--subprocesses`), sampling only threads that hold the GIL (`--gil`: on-CPU Python "
            "code), during a separate, unmeasured latency run per variant. Raw collapsed stacks: "
            f"`{self.r.profile_dir}`.",
            "",
            "py-spy sees Python only. Most of a jail's cost is in the kernel (`perf`: "
            "copy-on-write faults, fork, exit, namespaces) and between processes (wake-ups); the "
            "[performance page](../docs/performance.md) puts these profiles together with "
            "`perf` and per-stage timestamps into where the warm and cold paths spend their time.",
        ]
        for key, flame in self.r.profiles.items():
            lines += ["", f"### {self.r.labels[key]}: {flame.samples:,} samples", ""]
            procs = [[_cell(p), f"{n / flame.samples:.0%}"] for p, n in flame.by_process]
            if procs:
                lines += [*_table(["process", "samples"], procs, "lr"), ""]
            rows = [
                [f"`{_cell(fn)}`", f"{n / flame.samples:.1%}"] for fn, n in flame.top_self
            ]
            lines += [*_table(["top functions, self", "samples"], rows, "lr"), ""]
            rows = [
                [f"`{_cell(fn)}`", f"{n / flame.samples:.1%}"] for fn, n in flame.top_total
            ]
            lines += _table(["top jaild functions, with callees", "samples"], rows, "lr")
        return lines

    def _errors(self) -> list[str]:
        lines = ["## Errors", ""]
        if self.r.errors:
            rows = [[f"`{k}`", v] for k, v in self.r.errors.items()]
            lines += _table(["measurement", "error"], rows, "ll")
        else:
            lines.append("None: every measurement attempted was made.")
        if self.r.skipped:
            lines += ["", *(f"- skipped `{k}`: {v}" for k, v in self.r.skipped.items())]
        return lines

    def _method(self) -> list[str]:
        s = self.s
        return [
            "## Method",
            "",
            f"- Latency: {s.runs} timed jobs per row after 2 untimed ones; Pyodide "
            f"{s.pyodide_runs} (a fresh `node` process loads Pyodide for every job, ~2 s each). "
            "p99 is the nearest-rank percentile: with fewer than 100 runs it is the slowest run.",
            f"- jaild warm latency is measured at a rate the pool sustains: "
            f"{s.warm_pause_s * 1e3:.0f} ms pause (untimed) before each job, so the pool refills.",
            "- jaild variants: one private `jaild serve` each, serving `policies/default.toml` "
            "plus a `[pool]` section: spawn = `mode = \"spawn\"`, min 0, max 0; cold = "
            "`mode = \"zygote\"`, min 0, max 0; warm = `mode = \"zygote\"`, min 4, max 8; the "
            f"memory-only pool daemon = `mode = \"zygote\"`, min = max = {s.pool_size}. jaild "
            "jobs end with a final expression `result` so the value comes back.",
            "- Subprocess baselines run the jail environment's python (`-I -c 'result = 1 + 1; "
            "print(result)'`) and read the result from stdout. Bare nsjail: user, pid, mount, "
            "net, ipc, uts and cgroup namespaces, read-only `/usr` and env, no `/proc`, no "
            "cgroups, no seccomp (`-Mo -Q`). bubblewrap: `--unshare-all --die-with-parent "
            "--new-session`, uid 65534, read-only `/usr` and env, private `/proc`, `/dev`, "
            "`/tmp`.",
            "- Peers (`[bench]` extra, versions under Machine): pydantic-monty and "
            "llm-sandbox rows time the same number of jobs after 2 untimed ones, with no "
            "pause; monty pools have one worker (`min_processes = max_processes = 1`). "
            "llm-sandbox runs with its defaults (no network, its seccomp deny-list) plus the "
            "jail environment read-only and its python, and jaild's nsjail binary. A peer "
            "not installed is skipped in a quick run and an error in a full one.",
            "- The client (this script) runs on the same 2 cores as the daemon and its jails.",
        ]
