"""``jaild.codemode``: the code-mode LLM loop, its exports and its metrics.

::

    from jaild.codemode import CodeMode

    async def search(query: str, limit: int = 3) -> list[str]:
        "Search the catalogue."
        ...

    cm = CodeMode(tools=[search], model="gpt-4o-mini", max_retries=3)
    r = await cm.run("Find three titles about jails and count their words")
    r.success, r.result, r.code, r.attempts, r.metrics
    cm.metrics.summary(); print(cm.metrics.table())

Theory of operation. :meth:`CodeMode.run` is a small loop around two pure steps:

1. The prompt. :func:`build_system_prompt` turns the tools (:mod:`jaild.toolspec`: name,
   description, JSON schema) into a system message that states the jail's conventions
   (top-level ``await``, ``await tools.NAME(...)``, the final expression is the result,
   ``print`` for output, the discovery helpers). The task is the first user message.
2. The answer. The model is asked through the official ``openai`` SDK (any server that
   speaks the chat-completions API, via ``base_url``). :func:`extract_code` takes the
   program out of the reply; :func:`check_syntax` compiles it locally (top-level
   ``await`` allowed), so a syntax error costs no jail. The program runs in jaild under
   the chosen policy with the tools as host tools.

A failure the code caused (a syntax error, or a job status other than ``ok`` except
``cancelled`` / ``internal_error``, which are not the code's doing) is turned by
:func:`feedback_message` into the next user message (error type, message, traceback,
stderr tail) and the model tries again, at most ``max_retries`` times after the first
attempt. Errors of the model's API (``openai.OpenAIError``) and refusals of the daemon
(:class:`jaild.errors.JaildError`) are raised, not retried: they are not the code's fault.

By default every attempt runs in a fresh jail: a retry is a complete program and starts
clean, as the first attempt did (half-done state of a failed attempt would hide bugs, and
fresh jails come from the warm pool). ``session=True`` runs the attempts of one ``run``
in one jaild session instead, so a retry can build on what earlier attempts defined;
inside ``async with cm:`` the session lasts until the block ends, across runs, code runs
and tool calls (codemode-lite's persistent namespace).

Traces (:mod:`jaild.tracing`; docs/using/tracing.md). Where OpenTelemetry is set up (the
application's tracer provider; ``jaild codemode`` sets one up when ``OTEL_TRACES_EXPORTER``
asks), :meth:`CodeMode.run` is one trace: a ``codemode.task`` span, a ``codemode.attempt``
span per attempt, in it a ``chat <model>`` span for the model's answer (GenAI semantic
conventions: model, token counts; never the prompt, the reply or the code) and the jail
job, whose spans the daemon makes as children of the attempt (``RunJob.traceparent``).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import keyword
import os
import re
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaild import tracing
from jaild.address import add_tls_arguments
from jaild.client import Approver, AsyncClient, AsyncSession, JobResult
from jaild.errors import SessionClosed
from jaild.extras import require
from jaild.providers import TOOLS_FLAG_HELP
from jaild.toolspec import HostTool, describe_flow, describe_network, normalize_tools

if TYPE_CHECKING:
    from langchain_core.tools import BaseTool
    from openai import AsyncOpenAI
    from openai.types.chat import (
        ChatCompletionFunctionToolParam,
        ChatCompletionMessageParam,
        ChatCompletionToolMessageParam,
    )
    from openai.types.shared_params import FunctionDefinition

DEFAULT_MODEL = "gpt-4o-mini"
DEFAULT_TOOL_NAME = "run_python"
NOT_RETRIED = frozenset({"cancelled", "internal_error"})
"""Job statuses that are not the code's doing: the loop stops instead of asking again."""
STDERR_TAIL_CHARS = 2000
STDOUT_TAIL_CHARS = 1000
TOOL_OUTPUT_CHARS = 20_000
"""How much stdout/stderr the exported tool gives the model (each)."""
TRACER = "jaild.codemode"
"""The instrumentation scope of the loop's spans (:func:`jaild.tracing.span`)."""
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
_DISCOVERY = {
    "discover": "`await tools.discover()` lists every tool with its description",
    "schema": '`await tools.schema("NAME")` returns one tool\'s JSON schema',
    "search": '`await tools.search("keyword")` finds tools by name or description',
}


# ---------------------------------------------------------------------------- prompt


def _type_label(schema: Mapping[str, Any]) -> str:
    """A Python-looking type for a JSON schema (the prompt's signatures)."""
    if "enum" in schema:
        return " | ".join(repr(v) for v in schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return " | ".join(_type_label(s) for s in schema.get("anyOf", schema.get("oneOf", [])))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type_label({"type": k}) for k in kind)
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        return f"list[{_type_label(schema['items'])}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return f"dict[str, {_type_label(schema['additionalProperties'])}]"
    names = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
             "null": "None", "object": "dict", "array": "list"}
    return names.get(str(kind), "Any")


def tool_call_syntax(tool: HostTool) -> str:
    """How jailed code calls ``tool``: ``tools.add(a: int, b: int = 0)``."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    params = []
    for name, schema in props.items():
        text = f"{name}: {_type_label(schema)}"
        if name not in required and "default" in schema:
            text += f" = {schema['default']!r}"
        elif name not in required:
            text += " = ..."
        params.append(text)
    extra = tool.parameters.get("additionalProperties")
    if extra is True or isinstance(extra, Mapping):
        params.append("**kwargs")
    ident = tool.name.isidentifier() and not keyword.iskeyword(tool.name)
    target = f"tools.{tool.name}" if ident else f"tools[{tool.name!r}]"
    return f"{target}({', '.join(params)})"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def _discovery_line(tools: Mapping[str, HostTool]) -> str:
    """The discovery helpers, minus any whose name a host tool takes."""
    helpers = [text for name, text in _DISCOVERY.items() if name not in tools]
    return "; ".join(helpers)


def build_system_prompt(
    tools: Mapping[str, HostTool], instructions: str = "", network: str = "",
    flow: Sequence[str] = (),
) -> str:
    """The system message: the jail's conventions, then every tool with its schema.

    Args:
        tools: the host tools (``normalize_tools`` output).
        instructions: extra text appended at the end (house rules, output format, ...).
        network: the policy's network in words (:func:`jaild.toolspec.describe_network`);
            empty: the usual "normally no network".
        flow: the policy's information-flow rules in words (``PolicyEntry.flow``): which
            sends close once the program has read labelled data.

    Returns:
        The prompt text.
    """
    lines = [
        "You solve the user's task by writing one Python 3 program. It runs in an isolated "
        "sandbox: normally no network, a throwaway working directory, the standard library "
        "(other packages only if the sandbox has them). It reaches the outside world through "
        "the host tools listed below.",
        *([f"Network: {network}"] if network else []),
        *describe_flow(flow),
        "",
        "Rules:",
        "- Reply with the complete program in a single ```python code block.",
        "- Top-level `await` works. Do not call asyncio.run(); do not define a main() "
        "unless you want it to be called for you (its return value is then the result).",
        "- Call a tool with `await tools.NAME(arg=value, ...)`, keyword arguments as in its "
        'schema; a name that is not a Python identifier: `await tools["NAME"](...)`. '
        "Independent calls can run together: "
        "`a, b = await asyncio.gather(tools.x(...), tools.y(...))`.",
        "- A tool that fails raises `ToolError` (attributes: tool, error_type, message).",
        "- The value of the final expression statement is the program's result: end with "
        "it (for example `summary` or `{\"count\": n}`), and make it plain data (dict, "
        "list, str, int, float, bool, None). print() what a person should read.",
    ]
    discovery = _discovery_line(tools)
    if discovery:
        lines.append(f"- Every tool is described below; to look them up from code: {discovery}.")
    lines += ["", "Tools:" if tools else "There are no host tools for this task."]
    for tool in tools.values():
        lines += ["", f"### {tool.name}", f"Call: await {tool_call_syntax(tool)}"]
        if tool.description.strip():
            lines.append(tool.description.strip())
        lines.append("Parameters (JSON schema): "
                     + json.dumps(tool.parameters, sort_keys=True, default=repr))
    if instructions.strip():
        lines += ["", instructions.strip()]
    return "\n".join(lines)


def describe_tools_briefly(tools: Mapping[str, HostTool]) -> str:
    """One line per tool (signature: first line of its description), for tool exports."""
    return "\n".join(
        f"- {tool_call_syntax(t)}" + (f": {_first_line(t.description)}" if t.description else "")
        for t in tools.values()
    )


# ---------------------------------------------------------------------------- the model's reply

_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_FENCE = re.compile(
    r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+.#-]*)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S
)
_OPEN_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+.#-]*)[^\n]*\n(.*)\Z", re.M | re.S)
_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3", "pycon", "ipython"})


def extract_code(reply: str) -> str:
    """The program in a model's reply.

    The ```python (or ```py) fenced blocks, joined in order; if none, the untagged
    fenced blocks; if there is no fence at all, the whole reply. A reasoning model's
    ``<think>...</think>`` is dropped first, and a fence the reply never closed (a
    reply cut at its token limit) runs to the end.

    Args:
        reply: the assistant message's text.

    Returns:
        The code, dedented and stripped ("" for an empty reply).
    """
    text = _THINK.sub("", reply or "")
    blocks = [(m.group(2).lower(), m.group(3)) for m in _FENCE.finditer(text)]
    if not blocks:
        unterminated = _OPEN_FENCE.search(text)
        if unterminated is not None:
            blocks = [(unterminated.group(2).lower(), unterminated.group(3))]
    chosen = [body for tag, body in blocks if tag in _PYTHON_TAGS] or [
        body for tag, body in blocks if not tag
    ]
    if not chosen:
        return textwrap.dedent(text).strip() if not blocks else text.strip()
    return "\n\n".join(textwrap.dedent(body).strip("\n") for body in chosen).strip()


def check_syntax(code: str, filename: str = "<codemode>") -> dict[str, Any] | None:
    """Compile ``code`` as jaild will (top-level ``await`` allowed).

    Returns:
        None if it compiles, else an error record like the jail's: ``type``, ``message``,
        ``lineno``, ``offset``, ``text`` (the offending line).
    """
    try:
        compile(code, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        return {
            "type": type(exc).__name__,
            "message": exc.msg,
            "lineno": exc.lineno,
            "offset": exc.offset,
            "text": (exc.text or "").rstrip("\n"),
        }
    except ValueError as exc:  # source code string cannot contain null bytes
        return {"type": "SyntaxError", "message": str(exc), "lineno": None}
    return None


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters before]\n" + (
        text[-limit:]
    )


def feedback_message(attempt: Attempt, attempts_left: int) -> str:
    """The user message that tells the model why ``attempt`` failed and asks for a fix."""
    error = attempt.error or {}
    where = f" (line {error['lineno']})" if error.get("lineno") else ""
    if attempt.status == "no_code":
        head = "Your reply contained no code."
    elif attempt.status == "syntax_error":
        head = f"Your code is not valid Python: {error.get('type', 'SyntaxError')}: " \
               f"{error.get('message', '')}{where}"
        if error.get("text"):
            head += f"\n    {error['text'].strip()}"
    else:
        kind = error.get("type") or attempt.status
        head = f"Your code failed (status {attempt.status}): {kind}: " \
               f"{error.get('message', '')}{where}"
        for key in ("limit", "signal", "syscall"):
            if error.get(key):
                head += f"\n{key}: {error[key]}"
    parts = [head]
    if error.get("traceback"):
        parts.append(str(error["traceback"]).rstrip())
    job = attempt.job
    if job is not None and job.stderr.strip():
        parts.append(f"stderr:\n{_tail(job.stderr, STDERR_TAIL_CHARS).rstrip()}")
    if job is not None and job.stdout.strip():
        parts.append(f"stdout:\n{_tail(job.stdout, STDOUT_TAIL_CHARS).rstrip()}")
    if job is not None and (job.session or {}).get("closed"):
        parts.append("That ended the session: the next program runs in a fresh jail where "
                     "nothing defined earlier exists.")
    parts.append(f"Fix the problem and reply with the whole corrected program in one "
                 f"```python block ({attempts_left} attempt{'s' if attempts_left != 1 else ''} "
                 "left).")
    return "\n\n".join(parts)


def format_for_model(job: JobResult) -> str:
    """A job's outcome as the text a tool-calling model reads (JSON): status, result,
    stdout, stderr and, on failure, the error's type, message and traceback."""
    out: dict[str, Any] = {"status": job.status, "result": job.result}
    if job.stdout:
        out["stdout"] = job.stdout if len(job.stdout) <= TOOL_OUTPUT_CHARS else (
            job.stdout[:TOOL_OUTPUT_CHARS] + f"\n[... {len(job.stdout) - TOOL_OUTPUT_CHARS} "
            "more characters]")
    if job.stderr:
        out["stderr"] = _tail(job.stderr, TOOL_OUTPUT_CHARS)
    if job.error:
        out["error"] = {k: job.error[k] for k in ("type", "message", "traceback", "lineno",
                                                   "limit", "signal", "syscall")
                        if job.error.get(k) is not None}
    return json.dumps(out, default=repr, ensure_ascii=False)


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TokenUsage:
    """Tokens as the API's ``usage`` reported them (0 when a server reports none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(self.prompt_tokens + other.prompt_tokens,
                          self.completion_tokens + other.completion_tokens,
                          self.total_tokens + other.total_tokens)

    @classmethod
    def from_api(cls, usage: Any) -> TokenUsage:
        if usage is None:
            return cls()
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        completion = int(getattr(usage, "completion_tokens", 0) or 0)
        total = int(getattr(usage, "total_tokens", 0) or 0) or prompt + completion
        return cls(prompt, completion, total)

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass
class Attempt:
    """One try: the model's code and what became of it."""

    number: int
    """1 for the first attempt."""
    code: str
    status: str
    """The job's status (``ok``, ``error``, ``timeout``, ...), or ``syntax_error`` / ``no_code``
    when the code never reached a jail."""
    error: dict[str, Any] | None
    llm_s: float = 0.0
    """Time waiting for the model's reply (0 for code not written by the model)."""
    execution_s: float = 0.0
    """Wall time of the jail job, as the client saw it (0 when no job ran)."""
    tokens: TokenUsage = field(default_factory=TokenUsage)
    job: JobResult | None = None
    reply: str = ""
    """The model's reply, verbatim."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "code": self.code,
            "status": self.status,
            "error": self.error,
            "llm_s": round(self.llm_s, 6),
            "execution_s": round(self.execution_s, 6),
            "tokens": self.tokens.to_dict(),
            "job_id": self.job.job_id if self.job else None,
        }


@dataclass(frozen=True)
class RunMetrics:
    """What one :meth:`CodeMode.run` (or :meth:`CodeMode.run_code`) cost."""

    tokens: TokenUsage
    retries: int
    llm_calls: int
    llm_s: float
    execution_s: float
    total_s: float
    tool_calls: int

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.tokens.to_dict(),
            "retries": self.retries,
            "llm_calls": self.llm_calls,
            "llm_s": round(self.llm_s, 6),
            "execution_s": round(self.execution_s, 6),
            "total_s": round(self.total_s, 6),
            "tool_calls": self.tool_calls,
        }


@dataclass(frozen=True)
class CodeModeResult:
    """The outcome of :meth:`CodeMode.run`: the last attempt's job and code, every attempt,
    and the metrics."""

    success: bool
    job: JobResult | None
    """The last job that ran (None if no attempt reached a jail)."""
    code: str
    """The last attempt's code (the one that succeeded, on success)."""
    attempts: list[Attempt]
    metrics: RunMetrics
    task: str | None = None

    @property
    def result(self) -> Any:
        """The program's result value (None unless it succeeded)."""
        return self.job.result if self.success and self.job is not None else None

    @property
    def stdout(self) -> str:
        return self.job.stdout if self.job is not None else ""

    @property
    def error(self) -> dict[str, Any] | None:
        """The last attempt's error (None on success)."""
        return self.attempts[-1].error if self.attempts else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "task": self.task,
            "result": self.result,
            "code": self.code,
            "error": self.error,
            "attempts": [a.to_dict() for a in self.attempts],
            "metrics": self.metrics.to_dict(),
            "job": self.job.to_dict() if self.job is not None else None,
        }


class CodeModeMetrics:
    """Totals across every run of one :class:`CodeMode` (``cm.metrics``).

    A *run* is one task given to :meth:`CodeMode.run`; an *execution* is one jail job
    (every attempt that reached a jail, every :meth:`CodeMode.run_code` and exported-tool
    call).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.runs = 0
        self.successes = 0
        self.retries = 0
        self.llm_calls = 0
        self.tokens = TokenUsage()
        self.llm_s = 0.0
        self.executions = 0
        self.successful_executions = 0
        self.execution_s = 0.0
        self.tool_calls = 0
        self.total_s = 0.0

    def record_execution(self, job: JobResult, execution_s: float) -> None:
        self.executions += 1
        self.successful_executions += job.ok
        self.execution_s += execution_s
        self.tool_calls += len(job.tool_calls) + job.tool_calls_omitted

    def record_run(self, result: CodeModeResult) -> None:
        """Count one finished :meth:`CodeMode.run` (its executions were counted as they ran)."""
        m = result.metrics
        self.runs += 1
        self.successes += result.success
        self.retries += m.retries
        self.llm_calls += m.llm_calls
        self.tokens = self.tokens + m.tokens
        self.llm_s += m.llm_s
        self.total_s += m.total_s

    def summary(self) -> dict[str, Any]:
        """The totals as a dict (times in seconds)."""
        return {
            "runs": self.runs,
            "successes": self.successes,
            "success_rate": self.successes / self.runs if self.runs else 0.0,
            "retries": self.retries,
            "mean_retries": self.retries / self.runs if self.runs else 0.0,
            "llm_calls": self.llm_calls,
            **self.tokens.to_dict(),
            "llm_s": round(self.llm_s, 6),
            "executions": self.executions,
            "successful_executions": self.successful_executions,
            "execution_s": round(self.execution_s, 6),
            "mean_execution_s": round(self.execution_s / self.executions, 6)
            if self.executions else 0.0,
            "tool_calls": self.tool_calls,
            "total_s": round(self.total_s, 6),
        }

    def table(self) -> str:
        """The totals as a two-column text table."""
        s = self.summary()
        rows = [
            ("runs", f"{s['runs']}"),
            ("successes", f"{s['successes']} ({s['success_rate']:.0%})"),
            ("retries", f"{s['retries']} (mean {s['mean_retries']:.2f} a run)"),
            ("LLM calls", f"{s['llm_calls']}"),
            ("tokens", f"{s['total_tokens']} (prompt {s['prompt_tokens']}, "
                       f"completion {s['completion_tokens']})"),
            ("LLM time", f"{s['llm_s']:.3f} s"),
            ("executions", f"{s['executions']} ({s['successful_executions']} ok)"),
            ("execution time", f"{s['execution_s']:.3f} s (mean {s['mean_execution_s']:.3f} s)"),
            ("tool calls", f"{s['tool_calls']}"),
            ("run time", f"{s['total_s']:.3f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        rule = "-" * (width + 2 + max(len(value) for _, value in rows))
        head = f"{'metric'.ljust(width)}  value"
        return "\n".join([head, rule, *(f"{n.ljust(width)}  {v}" for n, v in rows)])

    format_table = table  # python-codemode's name


# ---------------------------------------------------------------------------- execution


class _Executor:
    """Runs code for one scope: a fresh jail per job, or one session (reopened when a run
    ends it)."""

    def __init__(self, cm: CodeMode, client: AsyncClient, use_session: bool) -> None:
        self._cm = cm
        self._client = client
        self.client = client
        self._use_session = use_session
        self._session: AsyncSession | None = None
        self._turns = asyncio.Lock()  # a session runs one job at a time

    async def _open_session(self, labels: tuple[str, ...]) -> AsyncSession:
        session = self._client.session(self._cm.policy, self._cm.tools,
                                       limits=self._cm.limits, approve=self._cm.approve,
                                       labels=labels)
        await session.open()
        self._session = session
        return session

    async def run(self, code: str, labels: Iterable[str] = ()) -> tuple[JobResult, float]:
        """Run ``code``, holding ``labels`` from its start (what the model that wrote it
        has read: :meth:`CodeMode.run` passes them on)."""
        cm = self._cm
        held = tuple(sorted(set(labels)))
        started = time.perf_counter()
        if not self._use_session:
            job = await self._client.run(code, cm.policy, cm.tools, timeout=cm.timeout,
                                         limits=cm.limits, approve=cm.approve, labels=held)
        else:
            async with self._turns:
                session = self._session
                if session is None or session.closed is not None:
                    session = await self._open_session(held)
                try:
                    job = await session.run(code, timeout=cm.timeout, labels=held)
                except SessionClosed:  # it went idle between our check and the run
                    session = await self._open_session(held)
                    job = await session.run(code, timeout=cm.timeout, labels=held)
        elapsed = time.perf_counter() - started
        cm.metrics.record_execution(job, elapsed)
        return job, elapsed

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


# ---------------------------------------------------------------------------- CodeMode


class CodeMode:
    """Ask a model to solve tasks by writing Python that runs in jaild and calls your tools.

    Args:
        tools: host tools: ``{"name": fn}``, ``[fn, ...]`` or :class:`HostTool` objects
            (plain or async functions; the schema comes from the signature).
        model: the chat model's name.
        base_url: an OpenAI-compatible API (``http://localhost:11434/v1``, ...); None:
            the SDK's default (``$OPENAI_BASE_URL`` or OpenAI).
        api_key: None: ``$OPENAI_API_KEY``; when that is unset too and ``base_url`` is
            given, a placeholder (local servers ignore it).
        policy: the jaild policy the code runs under.
        max_retries: how many times to ask again after a failed attempt (so at most
            ``max_retries + 1`` attempts).
        socket: the daemon's socket (default ``$JAILD_SOCKET`` or ``/run/jaild/jaild.sock``).
        timeout: wall-clock seconds per job (None: the policy's ``wall_time_s``).
        session: run the attempts of each :meth:`run` in one jaild session (see the module
            docstring); default False: every attempt starts in a fresh jail.
        client: a connected :class:`AsyncClient` to use (not closed here); default: each
            call connects its own, or ``async with cm:`` keeps one for the block.
        limits: per-job limits that tighten the policy's (``{"memory_mb": 128}``).
        llm: an ``openai.AsyncOpenAI`` to use instead of making one (not closed here).
        completion_kwargs: extra arguments for ``chat.completions.create`` (``temperature``,
            ``max_tokens``, ...).
        instructions: text appended to the system prompt.
        tool_name: the name of the exported tool (:meth:`as_openai_tool`, ...).
        on_attempt: called with each :class:`Attempt` as it ends (progress, logging).
        approve: the approval callback for tools that need approval (see
            :class:`jaild.client.AsyncClient`); without one such calls are denied.
        tracer_provider: the OpenTelemetry tracer provider of the loop's spans (see the
            module docstring); default: the global one.
    """

    def __init__(
        self,
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        model: str = DEFAULT_MODEL,
        base_url: str | None = None,
        api_key: str | None = None,
        policy: str = "default",
        max_retries: int = 3,
        socket: str | None = None,
        timeout: float | None = None,
        session: bool = False,
        client: AsyncClient | None = None,
        *,
        limits: Mapping[str, float] | None = None,
        llm: AsyncOpenAI | None = None,
        completion_kwargs: Mapping[str, Any] | None = None,
        instructions: str = "",
        tool_name: str = DEFAULT_TOOL_NAME,
        on_attempt: Callable[[Attempt], Any] | None = None,
        approve: Approver | None = None,
        tracer_provider: tracing.AnyTracerProvider | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, got {max_retries}")
        self.tools: dict[str, HostTool] = normalize_tools(tools)
        self.model = model
        self.base_url = base_url
        self.api_key = api_key
        self.policy = policy
        self.network = ""  # the policy's network in words, read from the daemon at first use
        self.flow: tuple[str, ...] = ()  # its information-flow rules in words (likewise)
        self.max_retries = max_retries
        self.socket = socket
        self.timeout = timeout
        self.session = session
        self.limits = dict(limits) if limits else None
        self.completion_kwargs = dict(completion_kwargs or {})
        self.instructions = instructions
        self.tool_name = tool_name
        self.on_attempt = on_attempt
        self.approve = approve
        self.tracer_provider = tracer_provider
        self.metrics = CodeModeMetrics()
        self._client = client
        self._llm = llm
        self._held: tuple[_Executor, AsyncClient | None] | None = None

    # -------------------------------------------------------------- scopes

    @property
    def system_prompt(self) -> str:
        return build_system_prompt(self.tools, self.instructions, self.network, self.flow)

    async def __aenter__(self) -> CodeMode:
        """Keep one daemon connection (and, with ``session=True``, one session) until exit."""
        own = None
        client = self._client
        if client is None:
            client = own = AsyncClient(self.socket, name="jaild-codemode")
            await client.connect()
        self._held = (_Executor(self, client, self.session), own)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End what ``async with`` opened (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            executor, own = held
            try:
                await executor.aclose()
            finally:
                if own is not None:
                    await own.close()

    @contextlib.asynccontextmanager
    async def _executor(self) -> AsyncIterator[_Executor]:
        if self._held is not None:
            yield self._held[0]
            return
        client = self._client
        own = client is None
        if client is None:
            client = AsyncClient(self.socket, name="jaild-codemode")
            await client.connect()
        executor = _Executor(self, client, self.session)
        try:
            yield executor
        finally:
            try:
                await executor.aclose()
            finally:
                if own:
                    await client.close()

    async def _learn_network(self, client: AsyncClient) -> None:
        """The policy's network, in words, for the prompt (once per CodeMode)."""
        if self.network:
            return
        for entry in await client.policies():
            if entry["name"] == self.policy:
                self.network = describe_network(entry["network"], entry.get("egress", ()))
                self.flow = tuple(entry.get("flow", ()))

    @contextlib.asynccontextmanager
    async def _model(self) -> AsyncIterator[AsyncOpenAI]:
        if self._llm is not None:
            yield self._llm
            return
        require("codemode", "CodeMode")
        from openai import AsyncOpenAI

        api_key = self.api_key or os.environ.get("OPENAI_API_KEY")
        if api_key is None and (self.base_url or os.environ.get("OPENAI_BASE_URL")):
            api_key = "unused"  # a local server that wants no key
        async with AsyncOpenAI(base_url=self.base_url, api_key=api_key) as llm:
            yield llm

    # -------------------------------------------------------------- the loop

    async def run(self, task: str) -> CodeModeResult:
        """Solve ``task``: ask the model for code, run it, feed failures back, retry.

        Args:
            task: what the program should do, in words.

        Returns:
            A :class:`CodeModeResult` (``success`` False once ``max_retries`` retries failed).

        Raises:
            openai.OpenAIError: the model's API failed (after the SDK's own retries).
            JaildError: the daemon refused the job (unknown policy, ...) or is not there.
        """
        started = time.perf_counter()
        attempts: list[Attempt] = []
        last_job: JobResult | None = None
        with tracing.span("codemode.task", {
            "jaild.policy": self.policy, GEN_AI_MODEL: self.model,
            "jaild.codemode.max_retries": self.max_retries,
        }, tracer=TRACER, provider=self.tracer_provider) as task_span:
            async with self._model() as llm, self._executor() as executor:
                await self._learn_network(executor.client)
                messages: list[ChatCompletionMessageParam] = [
                    {"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": task},
                ]
                # the labels of every run whose record the model reads back (the feedback):
                # each later attempt holds them from its start, so what a labelled result
                # said cannot reach a protected call through the model's next code
                seen: set[str] = set()
                for number in range(1, self.max_retries + 2):
                    attempt = await self._attempt(number, llm, executor, messages, seen)
                    if attempt.job is not None:
                        last_job = attempt.job
                    attempts.append(attempt)
                    if self.on_attempt is not None:
                        self.on_attempt(attempt)
                    if attempt.ok or attempt.status in NOT_RETRIED:
                        break
                    if number <= self.max_retries:
                        messages.append({"role": "assistant", "content": attempt.reply})
                        messages.append({"role": "user", "content": feedback_message(
                            attempt, self.max_retries + 1 - number)})
            result = CodeModeResult(
                success=attempts[-1].ok,
                job=last_job,
                code=attempts[-1].code,
                attempts=attempts,
                metrics=_run_metrics(attempts, time.perf_counter() - started),
                task=task,
            )
            task_span.set({"jaild.codemode.success": result.success,
                           "jaild.codemode.attempts": len(attempts),
                           GEN_AI_INPUT_TOKENS: result.metrics.tokens.prompt_tokens,
                           GEN_AI_OUTPUT_TOKENS: result.metrics.tokens.completion_tokens})
        self.metrics.record_run(result)
        return result

    async def _attempt(
        self,
        number: int,
        llm: AsyncOpenAI,
        executor: _Executor,
        messages: list[ChatCompletionMessageParam],
        seen: set[str],
    ) -> Attempt:
        """One attempt: ask the model (a ``chat`` span), then run its code in jaild (the
        job's spans, made by the daemon, join this attempt's span through its traceparent).
        What the spans say: sizes, tokens, statuses and error types, never the prompt, the
        reply or the code."""
        provider = self.tracer_provider
        with tracing.span("codemode.attempt", {"jaild.codemode.attempt": number},
                          tracer=TRACER, provider=provider) as attempt_span:
            with tracing.span(f"chat {self.model}", {
                "gen_ai.operation.name": "chat", GEN_AI_MODEL: self.model,
                "gen_ai.provider.name": "openai",
            }, client=True, tracer=TRACER, provider=provider) as chat_span:
                asked = time.perf_counter()
                response = await llm.chat.completions.create(
                    model=self.model, messages=messages, **self.completion_kwargs
                )
                llm_s = time.perf_counter() - asked
                tokens = TokenUsage.from_api(response.usage)
                chat_span.set({
                    "gen_ai.response.model": str(response.model or self.model),
                    GEN_AI_INPUT_TOKENS: tokens.prompt_tokens,
                    GEN_AI_OUTPUT_TOKENS: tokens.completion_tokens,
                })
            reply = (response.choices[0].message.content or "") if response.choices else ""
            code = extract_code(reply)
            attempt = Attempt(number, code, "", None, llm_s=llm_s, tokens=tokens, reply=reply)
            syntax = check_syntax(code) if code else None
            if not code:
                attempt.status = "no_code"
                attempt.error = {"type": "NoCode", "message": "the reply contained no code"}
            elif syntax is not None:
                attempt.status, attempt.error = "syntax_error", syntax
            else:
                job, attempt.execution_s = await executor.run(code, seen)
                attempt.job = job
                if job.flow:
                    seen.update(job.flow.get("labels", ()))
                attempt.status, attempt.error = job.status, job.error
            attempt_span.set({"jaild.codemode.status": attempt.status,
                              "jaild.codemode.code_chars": len(code)})
            if attempt.error is not None:
                attempt_span.set({"jaild.error.type": str(attempt.error.get("type", ""))})
            return attempt

    async def run_code(self, code: str) -> JobResult:
        """Run ``code`` (written by you or a model) in jaild with this instance's tools,
        policy and limits. Returns the job's result record (look at ``status``)."""
        async with self._executor() as executor:
            job, _ = await executor.run(code)
        return job

    def run_sync(self, task: str) -> CodeModeResult:
        """:meth:`run` for code without an event loop (``asyncio.run`` under the hood)."""
        return asyncio.run(self.run(task))

    def run_code_sync(self, code: str) -> JobResult:
        """:meth:`run_code` for code without an event loop."""
        return asyncio.run(self.run_code(code))

    # -------------------------------------------------------------- exports

    def tool_description(self) -> str:
        """The exported tool's description: what it does, the conventions, the tools."""
        text = (
            "Run a Python 3 program in a fresh, isolated sandbox (normally no network; the "
            "standard library). Top-level `await` works. The value of the final expression is "
            "returned as `result`, print() output as `stdout`; a failure returns `status` "
            "and `error` with the traceback."
        )
        if self.network:  # known once the policy was read (a solve, or set by the caller)
            text += f" Network: {self.network}"
        if self.tools:
            text += (" The program can call these host tools with "
                     "`await tools.NAME(arg=value)`:\n" + describe_tools_briefly(self.tools))
            discovery = _discovery_line(self.tools)
            if discovery:
                text += f"\nTo look tools up from code: {discovery}."
        return text

    def as_openai_function(self) -> FunctionDefinition:
        """The bare function definition (legacy ``functions=[...]``)."""
        return {
            "name": self.tool_name,
            "description": self.tool_description(),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string",
                                        "description": "The Python program to run."}},
                "required": ["code"],
                "additionalProperties": False,
            },
        }

    def as_openai_tool(self) -> ChatCompletionFunctionToolParam:
        """The chat-completions ``tools=[...]`` entry."""
        return {"type": "function", "function": self.as_openai_function()}

    async def run_for_model(self, code: str) -> str:
        """What the exported tool does: run ``code``, return the outcome as JSON text for
        the model (:func:`format_for_model`)."""
        return format_for_model(await self.run_code(code))

    async def handle_tool_call(self, tool_call: Any) -> ChatCompletionToolMessageParam:
        """Execute a tool call the model made (an ``openai`` tool-call object or its dict).

        Returns:
            The ``{"role": "tool", "tool_call_id": ..., "content": ...}`` message to append
            to the conversation. Arguments that are not JSON with a ``code`` string give an
            error message for the model, without running anything.

        Raises:
            ValueError: the call is for another tool than :attr:`tool_name`.
        """
        function = _field(tool_call, "function")
        name = _field(function, "name") if function is not None else None
        if name != self.tool_name:
            raise ValueError(f"tool call {_field(tool_call, 'id')!r} is for {name!r}, "
                             f"not {self.tool_name!r}")
        raw = _field(function, "arguments")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as exc:
            arguments = None
            content = json.dumps({"status": "bad_arguments",
                                  "error": f"the arguments are not valid JSON: {exc}"})
        if isinstance(arguments, Mapping) and isinstance(arguments.get("code"), str):
            content = await self.run_for_model(arguments["code"])
        elif arguments is not None:
            content = json.dumps({"status": "bad_arguments",
                                  "error": 'expected {"code": "<python program>"}'})
        return {"role": "tool", "tool_call_id": _field(tool_call, "id"), "content": content}

    def as_langchain_tool(self) -> BaseTool:
        """A langchain-core ``StructuredTool`` (one argument, ``code``) that runs the code
        in jaild. Needs the ``jaild[langchain]`` extra.

        Raises:
            MissingExtra: langchain-core is not installed (an ``ImportError``).
        """
        require("langchain", "as_langchain_tool()")
        from langchain_core.tools import StructuredTool

        async def arun(code: str) -> str:
            return await self.run_for_model(code)

        def run(code: str) -> str:
            return asyncio.run(self.run_for_model(code))

        return StructuredTool.from_function(
            func=run, coroutine=arun, name=self.tool_name, description=self.tool_description()
        )


def _run_metrics(attempts: list[Attempt], total_s: float) -> RunMetrics:
    tokens = TokenUsage()
    for a in attempts:
        tokens = tokens + a.tokens
    return RunMetrics(
        tokens=tokens,
        retries=max(0, len(attempts) - 1),
        llm_calls=len(attempts),
        llm_s=sum(a.llm_s for a in attempts),
        execution_s=sum(a.execution_s for a in attempts),
        total_s=total_s,
        tool_calls=sum(len(a.job.tool_calls) + a.job.tool_calls_omitted
                       for a in attempts if a.job is not None),
    )


# ---------------------------------------------------------------------------- CLI


def add_codemode_commands(sub: Any) -> None:
    """Register ``jaild codemode`` on the CLI's subparsers."""
    p = sub.add_parser(
        "codemode", help="ask a model to solve a task by writing code run in jaild",
        description="Ask an OpenAI-compatible model to solve TASK by writing Python that runs "
                    "in jaild and calls the tools in --tools; failures are fed back and retried.",
    )
    p.add_argument("task", help="the task, in words")
    p.add_argument("--tools", action="append", default=[], metavar="[GROUP=]FILE.py",
                   help="(repeatable) " + TOOLS_FLAG_HELP)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--base-url", help="an OpenAI-compatible API (default: $OPENAI_BASE_URL "
                                      "or OpenAI's)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="NAME",
                   help="the environment variable holding the API key (default OPENAI_API_KEY)")
    p.add_argument("--policy", default="default",
                   help="the policy the model's code runs under (default: default)")
    p.add_argument("--max-retries", type=int, default=3, metavar="N",
                   help="attempts after the first when the code fails (default: 3)")
    p.add_argument("--timeout", type=float, metavar="S", help="wall-clock seconds per job")
    p.add_argument("--session", action="store_true",
                   help="run all attempts in one jaild session (a retry sees earlier state)")
    p.add_argument("--socket", help="the daemon's socket (default: $JAILD_SOCKET or "
                                    "/run/jaild/jaild.sock; a private daemon if none runs), or tls://HOST:PORT")
    add_tls_arguments(p)
    p.add_argument("--show-code", action="store_true", help="print each attempt's code to stderr")
    p.add_argument("--json", action="store_true",
                   help="print the whole result (attempts, metrics, job record) as JSON")
    p.set_defaults(func=cmd_codemode)


def _err(msg: str) -> None:
    print(f"jaild codemode: {msg}", file=sys.stderr, flush=True)


def cmd_codemode(args: argparse.Namespace) -> int:
    """``jaild codemode``: 0 when the task succeeded, 1 when it failed (or the model's API
    did), 2 for usage errors, 65/69 as ``jaild run`` for daemon refusals / no daemon
    (:data:`jaild.errors.EXIT_CODES`); 1 with a line saying so without ``jaild[codemode]``."""
    require("codemode", "jaild codemode")
    from openai import OpenAIError

    from jaild.errors import (
        EXIT_USAGE,
        JaildError,
        ProviderError,
        TracingError,
        error_line,
        exit_code_for,
    )
    from jaild.providers import load_modules

    try:  # named as jaild run and jaild mcp name them (jaild.providers.module_sources)
        tools = load_modules(args.tools)
    except ProviderError as exc:
        _err(str(exc))
        return EXIT_USAGE
    if args.max_retries < 0:
        _err("--max-retries must be 0 or more")
        return EXIT_USAGE
    api_key = os.environ.get(args.api_key_env)
    if not api_key and not (args.base_url or os.environ.get("OPENAI_BASE_URL")):
        _err(f"set {args.api_key_env} to the API key (or name another variable with "
             "--api-key-env), or give --base-url for a server that needs none")
        return EXIT_USAGE

    def progress(attempt: Attempt) -> None:
        if args.show_code:
            _err(f"attempt {attempt.number} code:\n{attempt.code}")
        if not attempt.ok:
            error = attempt.error or {}
            _err(f"attempt {attempt.number}: {attempt.status}: "
                 f"{error.get('type', '')}: {error.get('message', '')}")

    cm = CodeMode(tools, model=args.model, base_url=args.base_url, api_key=api_key or None,
                  policy=args.policy, max_retries=args.max_retries, timeout=args.timeout,
                  session=args.session, on_attempt=progress)
    try:
        with tracing.exporting("jaild-codemode"):  # when OTEL_TRACES_EXPORTER asks
            result = asyncio.run(_cli_run(cm, args.task, args.socket))
    except TracingError as exc:
        _err(exc.message)
        return exit_code_for(exc)
    except JaildError as exc:
        _err(error_line(exc))
        return exit_code_for(exc)
    except OpenAIError as exc:
        _err(f"the model's API failed: {type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        json.dump(result.to_dict(), sys.stdout, default=repr)
        sys.stdout.write("\n")
    else:
        if result.stdout:
            sys.stdout.write(result.stdout)
        if result.success and result.result is not None:
            value = result.result
            print(value if isinstance(value, str) else json.dumps(value, default=repr))
        if not result.success:
            error = result.error or {}
            if error.get("traceback"):
                sys.stderr.write(str(error["traceback"]))
            _err(f"failed after {len(result.attempts)} attempt(s): {result.attempts[-1].status}"
                 f": {error.get('message', '')}")
        m = result.metrics
        retries = "retry" if m.retries == 1 else "retries"
        _err(f"{len(result.attempts)} attempt(s), {m.retries} {retries}, "
             f"{m.tokens.total_tokens} tokens, model {m.llm_s:.2f} s, "
             f"jail {m.execution_s:.2f} s, total {m.total_s:.2f} s")
    return 0 if result.success else 1


async def _cli_run(cm: CodeMode, task: str, socket: str | None) -> CodeModeResult:
    """Run against the daemon at the named socket (``--socket``, ``$JAILD_SOCKET``) or the
    default one; with none named and none listening, in a private daemon started for this
    one command (as ``jaild run``)."""
    from jaild.daemon.config import DaemonConfig
    from jaild.daemon.private import daemon_socket

    def announce(path: str) -> None:
        _err(f"no daemon at {path}; running in a private daemon")

    async with daemon_socket(socket, DaemonConfig.from_sources, cm.policy, announce) as path:
        cm.socket = path
        return await cm.run(task)
