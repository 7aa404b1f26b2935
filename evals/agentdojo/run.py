"""Running the replay's jobs through a jaild daemon and judging them (replay.py says what a
job is). Each job gets its own environment copy and its own tools bound to it; jobs run
``parallel`` at a time over one blocking client (its tool handlers run in worker threads)."""

from __future__ import annotations

import fnmatch
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from jaild.client import Client, JobResult

from .modes import Mode, planning, policy_name
from .replay import (
    PairCase,
    SuiteCase,
    Trace,
    UtilityCase,
    _calls,
    attack_code,
    host_tools,
    plan_code,
    utility_code,
)

Kind = Literal["utility", "attack"]


@dataclass
class Outcome:
    """One job's outcome (``kind`` ``attack``: a pair; ``utility``: a user task)."""

    kind: Kind
    suite: str
    user_task: str
    mode: Mode
    injection_task: str = ""
    status: str = ""
    """The job's status (``ok``), or ``skipped`` (a pair whose user task reads no injection)."""
    judged: bool | None = None
    """utility: the task's ``utility()``; attack: the injection task's ``security()`` (True:
    the attack succeeded)."""
    utility_under_attack: bool | None = None
    vectors: list[str] = field(default_factory=list)
    reached: bool = False
    """attack: a result carrying the injection was returned to the job."""
    attacker_planned: int = 0
    """attack: the injection task's ground-truth calls (0: AgentDojo gives none -- the
    workspace's injection tasks 6 to 13 and travel's 6 -- so only the text the job returns
    can act for the attacker)."""
    attacker_calls: int = 0
    """attack: the attacker's calls that ran (on the host)."""
    calls_planned: int = 0
    calls_ran: int = 0
    refusals: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    approvals: int = 0
    result_withheld: bool = False
    seconds: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 4)}


class Runner:
    """Runs utility and attack jobs through ``client``."""

    def __init__(self, client: Client, suites: dict[str, SuiteCase],
                 flows: dict[str, Any] | None = None) -> None:
        """``flows``: each suite's policy's ``[flow]`` table (what a planning job reads:
        which tools' results are untrusted, which tools may be planned)."""
        self.client = client
        self.suites = suites
        self.flows = flows or {}

    def _predicates(self, suite: str) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
        flow = self.flows.get(suite, {})
        untrusted = set(flow.get("untrusted", ["untrusted"]))
        sources = [s["tool"] for s in flow.get("source", []) if untrusted & set(s["labels"])]
        plans = [p["tool"] for p in flow.get("plan", [])]
        return ((lambda name: any(fnmatch.fnmatchcase(name, g) for g in sources)),
                (lambda name: any(fnmatch.fnmatchcase(name, g) for g in plans)))

    def _run(self, code: str, policy: str, tools: list[Any], approvals: list[int]
             ) -> JobResult:
        lock = threading.Lock()

        def approve(name: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
            with lock:
                approvals[0] += 1
            return True

        return self.client.run(code, policy, tools=tools, approve=approve)  # the policy's limits

    @staticmethod
    def _record(outcome: Outcome, r: JobResult, trace: Trace) -> str:
        """Fill what every job has from its record; return the model's output text."""
        outcome.status = r.status
        flow = r.flow or {}
        outcome.labels = sorted(flow.get("labels", []))
        outcome.refusals = sorted({str(x.get("code", "")) for x in flow.get("refusals", [])})
        outcome.calls_ran = len(trace.calls)
        outcome.result_withheld = "result" in flow.get("withheld", [])
        if r.status != "ok":
            outcome.error = str(r.error)[:500]
        return r.result if isinstance(r.result, str) else ""

    def utility(self, case: UtilityCase, mode: Mode) -> Outcome:
        s = self.suites[case.suite]
        task = s.suite.user_tasks[case.user_task]
        environment = task.init_environment(s.clean_environment())
        pre = environment.model_copy(deep=True)
        calls = _calls(task.ground_truth(environment))
        outcome = Outcome("utility", case.suite, case.user_task, mode, calls_planned=len(calls))
        trace = Trace()
        approvals = [0]
        started = time.perf_counter()
        title = f"AgentDojo {case.suite} {case.user_task}: its ground truth"
        request = None
        if planning(mode):
            untrusted, planned = self._predicates(case.suite)
            code = plan_code(title, calls, task.GROUND_TRUTH_OUTPUT, untrusted=untrusted,
                             planned=planned)
            request = task.PROMPT
        else:
            code = utility_code(title, calls, task.GROUND_TRUTH_OUTPUT)
        r = self._run(code, policy_name(case.suite, mode),
                      host_tools(s.suite, environment, trace, request), approvals)
        outcome.seconds = time.perf_counter() - started
        output = self._record(outcome, r, trace)
        outcome.approvals = approvals[0]
        outcome.judged = s.judge(task, output, pre, environment, trace.calls)
        return outcome

    def attack(self, case: PairCase, mode: Mode) -> Outcome:
        s = self.suites[case.suite]
        vectors = s.candidates(case.user_task)
        outcome = Outcome("attack", case.suite, case.user_task, mode, case.injection_task,
                          vectors=list(vectors))
        if not vectors:
            outcome.status = "skipped"
            return outcome
        task = s.suite.user_tasks[case.user_task]
        injection = s.suite.injection_tasks[case.injection_task]
        environment = task.init_environment(s.injected_environment(case.user_task,
                                                                   case.injection_task))
        pre = environment.model_copy(deep=True)
        calls = _calls(task.ground_truth(environment))
        attacker = _calls(injection.ground_truth(environment.model_copy(deep=True)))
        outcome.calls_planned = len(calls)
        outcome.attacker_planned = len(attacker)
        trace = Trace()
        approvals = [0]
        title = (f"AgentDojo {case.suite} {case.user_task} attacked by {case.injection_task}: "
                 "the user task's ground truth, and the attacker's from the first injected "
                 "result on")
        request = None
        if planning(mode):
            untrusted, planned = self._predicates(case.suite)
            code = plan_code(title, calls, task.GROUND_TRUTH_OUTPUT, untrusted=untrusted,
                             planned=planned, attacker=attacker,
                             attacker_output=injection.GROUND_TRUTH_OUTPUT)
            request = task.PROMPT
        else:
            code = attack_code(title, calls, task.GROUND_TRUTH_OUTPUT, attacker,
                               injection.GROUND_TRUTH_OUTPUT)
        started = time.perf_counter()
        r = self._run(code, policy_name(case.suite, mode),
                      host_tools(s.suite, environment, trace, request), approvals)
        outcome.seconds = time.perf_counter() - started
        output = self._record(outcome, r, trace)
        outcome.approvals = approvals[0]
        outcome.reached = trace.first_injected is not None
        if trace.first_injected is not None:
            # the calls after the first injected result that are not the user task's own
            own = [(c.function, dict(c.args)) for c in calls]
            after = trace.calls[trace.first_injected + 1:]
            outcome.attacker_calls = sum(
                1 for c in after if (c.function, dict(c.args)) not in own)
        outcome.judged = s.judge(injection, output, pre, environment, trace.calls)
        outcome.utility_under_attack = s.judge(task, output, pre, environment, trace.calls)
        return outcome


Work = tuple[Kind, UtilityCase | PairCase, Mode]


def execute(runner: Runner, work: list[Work], parallel: int,
            progress: Callable[[str], None] | None = None) -> list[Outcome]:
    """Run every item of ``work``, ``parallel`` at a time; outcomes in ``work``'s order. A
    job that raises (the daemon refused it, the connection failed) is an outcome with
    status ``error``, not an exception: the run goes on and the report counts it."""

    def one(item: Work) -> Outcome:
        kind, case, mode = item
        try:
            if kind == "utility":
                assert isinstance(case, UtilityCase)
                return runner.utility(case, mode)
            assert isinstance(case, PairCase)
            return runner.attack(case, mode)
        except Exception as exc:
            return Outcome(kind, case.suite, case.user_task, mode,
                           getattr(case, "injection_task", ""), status="error",
                           error=f"{type(exc).__name__}: {exc}"[:500])

    outcomes: list[Outcome] = []
    started = time.monotonic()
    with ThreadPoolExecutor(parallel, thread_name_prefix="agentdojo-job") as pool:
        for n, outcome in enumerate(pool.map(one, work), 1):
            outcomes.append(outcome)
            if progress is not None and (n % 50 == 0 or n == len(work)):
                progress(f"{n}/{len(work)} jobs, {time.monotonic() - started:.0f} s")
    return outcomes


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def plan(utility: Iterable[UtilityCase], pairs: Iterable[PairCase],
         modes: Iterable[tuple[Kind, Mode]]) -> list[Work]:
    """The jobs of a run: each case in each of its kind's modes."""
    utility, pairs = list(utility), list(pairs)
    work: list[Work] = []
    for kind, mode in modes:
        cases: list[UtilityCase] | list[PairCase] = utility if kind == "utility" else pairs
        work += [(kind, case, mode) for case in cases]
    return work
