"""``python -m evals.agentdojo``: the model-free AgentDojo evaluation (replay.py's header says
what is run). It starts a private jaild daemon serving each suite's policy in three modes
(modes.py), runs the jobs through it, and writes the report (markdown) and the results
(JSON). Run it with ``.venv-agentdojo/bin/python`` (``make agentdojo-venv``), as root.

    python -m evals.agentdojo                      # every suite, every mode (make eval-agentdojo)
    python -m evals.agentdojo --smoke              # banking: every user task, 16 pairs, every mode
    python -m evals.agentdojo --suites banking --sample 20 --modes attack-on,attack-off
    python -m evals.agentdojo --pair banking:user_task_0:injection_task_1 --modes attack-on
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from .modes import MODES, Mode, policy_name, variant

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
POLICIES = HERE / "policies"
RUN_MODES = ("attack-on", "attack-exact", "attack-plan", "attack-open", "attack-open_exact",
             "attack-open_plan", "attack-off", "utility-on", "utility-exact", "utility-plan",
             "utility-approve", "utility-open", "utility-open_exact", "utility-open_plan",
             "utility-off")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evals.agentdojo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default="workspace,travel,banking,slack",
                   help="comma-separated suites (default: all four)")
    p.add_argument("--sample", type=int, metavar="N",
                   help="a fixed sample of N pairs per suite (utility: those pairs' user tasks)")
    p.add_argument("--smoke", action="store_true",
                   help="banking, every mode: each user task, and each once with an injection "
                        "task in turn (16 pairs)")
    p.add_argument("--pair", action="append", default=[], metavar="SUITE:USER:INJECTION",
                   help="run this pair only (repeatable; utility: their user tasks)")
    p.add_argument("--modes", default=",".join(RUN_MODES),
                   help=f"comma-separated, of {', '.join(RUN_MODES)} (default: all)")
    p.add_argument("--policies", type=Path, default=POLICIES,
                   help="the directory of SUITE.toml policies (default: evals/agentdojo/policies)")
    p.add_argument("--parallel", type=int, default=4, help="jobs at a time (default 4)")
    p.add_argument("--daemon-log", type=Path, help="keep the daemon's log (level debug) here")
    p.add_argument("--out", type=Path, help="the markdown report")
    p.add_argument("--json", type=Path, help="the results: figures and every job's outcome")
    args = p.parse_args(argv)
    if args.smoke:
        args.suites = "banking"
    args.suite_list = [s.strip() for s in args.suites.split(",") if s.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    from .replay import SUITES

    for s in args.suite_list:
        if s not in SUITES:
            p.error(f"--suites: {s!r} is not one of {', '.join(SUITES)}")
    for m in args.mode_list:
        if m not in RUN_MODES:
            p.error(f"--modes: {m!r} is not one of {', '.join(RUN_MODES)}")
    for pair in args.pair:
        if len(pair.split(":")) != 3:
            p.error(f"--pair: {pair!r} is not SUITE:USER_TASK:INJECTION_TASK")
    return args


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} ({cpu}, {os.cpu_count()} CPUs, Linux {platform.release()})"


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        import agentdojo  # noqa: F401
    except ImportError:
        print("evals.agentdojo needs jaild[agentdojo]: make agentdojo-venv, then run it with "
              ".venv-agentdojo/bin/python", file=sys.stderr)
        return 2
    from importlib.metadata import version

    from jaild.client import Client

    from .daemon import PrivateDaemon
    from .replay import (
        BENCHMARK_VERSION,
        PairCase,
        SuiteCase,
        UtilityCase,
        all_pairs,
        diagonal_pairs,
        sample_pairs,
    )
    from .report import markdown, results_json, summarize
    from .run import Kind, Runner, execute, plan, stderr_progress

    started = time.monotonic()
    suite_names = list(dict.fromkeys(
        [p.split(":")[0] for p in args.pair] if args.pair else args.suite_list))
    policies: dict[str, str] = {}
    flows: dict[str, Any] = {}
    policy_files = []
    for name in suite_names:
        path = args.policies / f"{name}.toml"
        if not path.is_file():
            print(f"evals.agentdojo: no policy for suite {name}: {path}", file=sys.stderr)
            return 2
        text = path.read_text()
        shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) \
            else path
        policy_files.append(f"{shown} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})")
        for mode in MODES:
            policies[policy_name(name, mode)] = variant(text, mode)
        flows[name] = tomllib.loads(text).get("flow", {})

    suites = {name: SuiteCase.load(name) for name in suite_names}
    if args.pair:
        pairs = [PairCase(*p.split(":")) for p in args.pair]
        for p in pairs:
            s = suites[p.suite]
            if p.user_task not in s.suite.user_tasks or \
                    p.injection_task not in s.suite.injection_tasks:
                print(f"evals.agentdojo: no such pair {p}", file=sys.stderr)
                return 2
    elif args.smoke:
        pairs = [p for name, s in suites.items() for p in diagonal_pairs(name, s)]
    else:
        pairs = all_pairs(suites)
        if args.sample is not None:
            pairs = sample_pairs(pairs, args.sample)
    if args.pair or args.sample is not None:
        utility = [UtilityCase(s, u) for s, u in dict.fromkeys((p.suite, p.user_task)
                                                               for p in pairs)]
    else:
        utility = [UtilityCase(name, u) for name, s in suites.items() for u in s.user_tasks]
    wanted: list[tuple[Kind, Mode]] = []
    for m in args.mode_list:
        kind, mode = m.split("-", 1)
        wanted.append(("attack" if kind == "attack" else "utility",
                       next(x for x in MODES if x == mode)))

    for case in suites.values():  # the canary runs, before the clock of the jobs starts
        case.candidates(case.user_tasks[0])
    seconds: dict[str, float] = {}
    outcomes = []
    with PrivateDaemon(policies, log_path=args.daemon_log,
                        log_level="debug" if args.daemon_log else "warning") as daemon, \
             Client(daemon.socket) as client:
        runner = Runner(client, suites, flows)
        for name in suite_names:
            work = plan([u for u in utility if u.suite == name],
                        [p for p in pairs if p.suite == name], wanted)
            suite_started = time.monotonic()
            stderr_progress(f"{name}: {len(work)} jobs")
            outcomes += execute(runner, work, args.parallel, stderr_progress)
            seconds[name] = time.monotonic() - suite_started
    wall = time.monotonic() - started
    seconds["all"] = wall
    summary = summarize(outcomes, suite_names, seconds)
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "machine": _machine(),
            "agentdojo": version("agentdojo"),
            "benchmark": BENCHMARK_VERSION,
            "suites": suite_names,
            "policies": policy_files,
            "modes": args.mode_list,
            "parallel": args.parallel,
            "jobs": len(outcomes),
            "wall_seconds": round(wall, 1),
            "command": "python -m evals.agentdojo " + shlex.join(sys.argv[1:] if argv is None
                                                                  else argv),
        },
        "summary": summary,
        "outcomes": [o.to_dict() for o in outcomes],
    }
    text = markdown(results)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(results_json(results))
    if not args.out:
        print(text)
    else:
        from .report import table

        print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
