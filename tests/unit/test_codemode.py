"""The code-mode loop's pure parts: code extraction, syntax check, prompt, feedback, metrics,
exports -- no network, no daemon."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest

from jaild.client import JobResult
from jaild.codemode import (
    Attempt,
    CodeMode,
    CodeModeMetrics,
    CodeModeResult,
    RunMetrics,
    TokenUsage,
    build_system_prompt,
    check_syntax,
    extract_code,
    feedback_message,
    format_for_model,
    tool_call_syntax,
)
from jaild.toolspec import HostTool, normalize_tools


def search(query: str, limit: int = 3, mode: Literal["any", "all"] = "any") -> list[str]:
    """Search the catalogue.

    Returns matching titles."""
    return []


async def fetch(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Fetch a page."""
    return {}


def _job(status: str = "ok", result: Any = None, *, stdout: str = "", stderr: str = "",
         error: dict[str, Any] | None = None, session: dict[str, Any] | None = None,
         tool_calls: int = 0) -> JobResult:
    return JobResult(job_id="job-0000000000000001", status=status, result=result, stdout=stdout,
                     stderr=stderr, error=error,
                     tool_calls=[{"name": "t", "duration_s": 0.001, "ok": True}] * tool_calls,
                     duration_s=0.01, limits={}, session=session)


# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(("reply", "code"), [
    ("```python\nx = 1\nx\n```", "x = 1\nx"),
    ("Here you go:\n\n```py\nprint('hi')\n```\nThis prints hi.", "print('hi')"),
    ("```\n1 + 1\n```", "1 + 1"),
    ("1 + 1", "1 + 1"),
    ("   \n  x = 2\n  x\n", "x = 2\nx"),
    ("", ""),
    # python blocks win over untagged ones and other languages; several are joined in order
    ("```json\n{\"a\": 1}\n```\n```python\na = 1\n```\ntext\n```python\na + 1\n```",
     "a = 1\n\na + 1"),
    ("```bash\npip install x\n```\n```\nimport x\n```", "import x"),
    # a reasoning model's thoughts are dropped, even when they contain fences
    ("<think>maybe ```python\nwrong()\n``` ?</think>\n```python\nright()\n```", "right()"),
    # a reply cut at its token limit: the open fence runs to the end
    ("```python\nfor i in range(3):\n    print(i)\n", "for i in range(3):\n    print(i)"),
    # fences inside the code's strings do not end the block early; tildes work too
    ('```python\ns = "```"\ns\n```', 's = "```"\ns'),
    ("~~~python\ny = 3\n~~~", "y = 3"),
    # an indented block (inside a list item) is dedented
    ("1. run this:\n   ```python\n   z = 1\n   if z:\n       z\n   ```", "z = 1\nif z:\n    z"),
])
def test_extract_code(reply: str, code: str) -> None:
    assert extract_code(reply) == code


def test_check_syntax_allows_top_level_await_and_reports_the_line() -> None:
    assert check_syntax("x = await tools.search(query='a')\nx") is None
    assert check_syntax("async with lock:\n    pass\nasync for x in it:\n    pass") is None
    err = check_syntax("x = 1\nfor i in range(3)\n    print(i)")
    assert err is not None
    assert (err["type"], err["lineno"], err["text"]) == ("SyntaxError", 2, "for i in range(3)")
    assert "expected ':'" in err["message"]
    assert check_syntax("x = '\\x00'") is None
    assert check_syntax("x = 1\x00")["type"] == "SyntaxError"  # type: ignore[index]


def test_check_syntax_does_not_inherit_our_future_imports() -> None:
    # this module has `from __future__ import annotations`; the jail's code does not
    assert check_syntax("def f(x: undefined_name): pass") is None  # compiles either way
    assert check_syntax("from __future__ import braces") is not None


# ---------------------------------------------------------------------------- prompt


def test_tool_call_syntax() -> None:
    tools = normalize_tools({"search": search, "fetch-page": fetch})
    assert tool_call_syntax(tools["search"]) == \
        "tools.search(query: str, limit: int = 3, mode: 'any' | 'all' = 'any')"
    assert tool_call_syntax(tools["fetch-page"]) == \
        "tools['fetch-page'](url: str, headers: dict[str, str] | None = None)"
    free = HostTool("free", "", {"type": "object", "properties": {"a": {"type": "array",
                    "items": {"type": "integer"}}}, "additionalProperties": True}, print)
    assert tool_call_syntax(free) == "tools.free(a: list[int] = ..., **kwargs)"
    assert tool_call_syntax(HostTool("class", "", {}, print)) == "tools['class']()"


def test_system_prompt_explains_the_conventions_and_lists_every_schema() -> None:
    tools = normalize_tools({"find": search, "fetch": fetch})
    prompt = build_system_prompt(tools, instructions="Answer in French.")
    for convention in ("```python", "Top-level `await`", "await tools.NAME(", "ToolError",
                       "final expression", "print()", "asyncio.gather",
                       "await tools.discover()", 'await tools.schema("NAME")',
                       'await tools.search("keyword")'):
        assert convention in prompt, convention
    assert "### find\nCall: await tools.find(query: str" in prompt
    assert "Search the catalogue.\n\nReturns matching titles." in prompt
    assert json.dumps(tools["find"].parameters, sort_keys=True) in prompt
    assert json.dumps(tools["fetch"].parameters, sort_keys=True) in prompt
    assert prompt.endswith("Answer in French.")
    assert "no host tools" in build_system_prompt({})


def test_a_discovery_helper_shadowed_by_a_tool_is_not_offered() -> None:
    prompt = build_system_prompt(normalize_tools({"search": search}))
    assert 'tools.search("keyword")' not in prompt and "tools.discover()" in prompt


# ---------------------------------------------------------------------------- feedback


def test_feedback_for_a_failed_job_carries_type_message_traceback_and_stderr_tail() -> None:
    tb = 'Traceback (most recent call last):\n  File "<job>", line 2\nNameError: name \'y\''
    job = _job("error", stderr="noise\n" * 1000 + "the last words\n", stdout="partial\n",
               error={"type": "NameError", "message": "name 'y' is not defined",
                      "traceback": tb, "lineno": 2})
    attempt = Attempt(1, "x = 1\ny", job.status, job.error, job=job)
    text = feedback_message(attempt, attempts_left=2)
    assert text.startswith("Your code failed (status error): NameError: name 'y' is not "
                           "defined (line 2)")
    assert tb in text and "the last words" in text and "partial" in text
    assert "characters before]" in text and len(text) < 4000  # the tail, not all of stderr
    assert text.endswith("(2 attempts left).")
    assert "1 attempt left" in feedback_message(attempt, 1)


def test_feedback_for_syntax_errors_limits_and_ended_sessions() -> None:
    err = check_syntax("for i in range(3)\n    print(i)")
    text = feedback_message(Attempt(1, "for ...", "syntax_error", err), 3)
    assert text.startswith("Your code is not valid Python: SyntaxError: expected ':' (line 1)")
    assert "    for i in range(3)" in text
    job = _job("timeout", error={"type": "Timeout", "message": "wall time limit of 1 s",
                                 "limit": "wall_time_s"},
               session={"id": "ses-1", "run": 2, "closed": "timeout"})
    text = feedback_message(Attempt(2, "while True: pass", "timeout", job.error, job=job), 1)
    assert "status timeout" in text and "limit: wall_time_s" in text
    assert "fresh jail" in text
    assert "no code" in feedback_message(Attempt(1, "", "no_code", None), 1)


def test_format_for_model() -> None:
    ok = json.loads(format_for_model(_job("ok", {"n": {1, 2}}, stdout="hello\n")))
    assert ok == {"status": "ok", "result": {"n": "{1, 2}"}, "stdout": "hello\n"}
    failed = json.loads(format_for_model(_job(
        "error", error={"type": "ValueError", "message": "bad", "traceback": "tb", "lineno": 3,
                        "extra": "dropped"})))
    assert failed["error"] == {"type": "ValueError", "message": "bad", "traceback": "tb",
                               "lineno": 3}
    flood = json.loads(format_for_model(_job("ok", stdout="x" * 50_000)))
    assert len(flood["stdout"]) < 21_000 and flood["stdout"].endswith("more characters]")


# ---------------------------------------------------------------------------- metrics


def _result(success: bool, retries: int, tokens: int, tool_calls: int = 0) -> CodeModeResult:
    attempts = [Attempt(i + 1, "x", "error", {"type": "E"}) for i in range(retries)]
    attempts.append(Attempt(retries + 1, "x", "ok" if success else "error", None))
    return CodeModeResult(
        success=success, job=None, code="x", attempts=attempts,
        metrics=RunMetrics(tokens=TokenUsage(tokens, tokens // 2, tokens + tokens // 2),
                           retries=retries, llm_calls=retries + 1, llm_s=0.5,
                           execution_s=0.25, total_s=1.0, tool_calls=tool_calls))


def test_metrics_summary_and_table() -> None:
    m = CodeModeMetrics()
    assert m.summary()["success_rate"] == 0.0 and m.summary()["mean_retries"] == 0.0
    m.record_execution(_job("error"), 0.1)
    m.record_execution(_job("ok", tool_calls=3), 0.3)
    m.record_run(_result(True, 1, 100))
    m.record_run(_result(False, 2, 200))
    m.record_execution(_job("ok", tool_calls=1), 0.2)  # a run_code
    s = m.summary()
    assert {k: s[k] for k in ("runs", "successes", "retries", "llm_calls", "prompt_tokens",
                              "completion_tokens", "total_tokens", "executions",
                              "successful_executions", "tool_calls")} == {
        "runs": 2, "successes": 1, "retries": 3, "llm_calls": 5, "prompt_tokens": 300,
        "completion_tokens": 150, "total_tokens": 450, "executions": 3,
        "successful_executions": 2, "tool_calls": 4}
    assert s["success_rate"] == 0.5 and s["mean_retries"] == 1.5
    assert s["llm_s"] == pytest.approx(1.0) and s["total_s"] == pytest.approx(2.0)
    assert s["execution_s"] == pytest.approx(0.6) and s["mean_execution_s"] == pytest.approx(0.2)
    table = m.table()
    assert table.splitlines()[0].split() == ["metric", "value"]
    assert "successes       1 (50%)" in table and "tokens          450 (prompt 300" in table
    assert m.format_table() == table
    m.reset()
    assert m.summary()["runs"] == 0


def test_token_usage_from_the_api() -> None:
    class Usage:
        prompt_tokens = 7
        completion_tokens = 5
        total_tokens = None

    assert TokenUsage.from_api(Usage()) == TokenUsage(7, 5, 12)
    assert TokenUsage.from_api(None) == TokenUsage()
    assert TokenUsage(1, 2, 3) + TokenUsage(10, 20, 30) == TokenUsage(11, 22, 33)


def test_result_record() -> None:
    r = _result(True, 1, 10)
    d = r.to_dict()
    assert d["success"] and d["metrics"]["retries"] == 1 and len(d["attempts"]) == 2
    assert d["attempts"][0]["error"] == {"type": "E"} and d["job"] is None
    assert r.result is None and r.stdout == "" and r.error is None
    json.dumps(d)


# ---------------------------------------------------------------------------- exports


def test_openai_exports() -> None:
    cm = CodeMode([search, fetch], tool_name="python")
    tool = cm.as_openai_tool()
    assert tool["type"] == "function" and tool["function"] == cm.as_openai_function()
    fn = tool["function"]
    assert fn["name"] == "python"
    assert fn["parameters"] == {"type": "object",
                                "properties": {"code": {"type": "string",
                                                        "description": "The Python program to run."}},
                                "required": ["code"], "additionalProperties": False}
    assert "- tools.search(query: str, limit: int = 3, mode: 'any' | 'all' = 'any'): " \
           "Search the catalogue." in fn["description"]
    assert "Returns matching titles" not in fn["description"]  # first lines only
    assert "- tools.fetch(url: str" in fn["description"]


def test_tool_calls_for_other_tools_or_with_bad_arguments() -> None:
    cm = CodeMode([search])
    with pytest.raises(ValueError, match="'get_weather', not 'run_python'"):
        asyncio.run(cm.handle_tool_call(
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}))
    for arguments in ("{not json", '{"source": "1"}', "[1]"):
        msg = asyncio.run(cm.handle_tool_call(
            {"id": "c2", "function": {"name": "run_python", "arguments": arguments}}))
        assert msg["role"] == "tool" and msg["tool_call_id"] == "c2"
        assert json.loads(str(msg["content"]))["status"] == "bad_arguments"
    assert cm.metrics.summary()["executions"] == 0  # nothing ran


def test_max_retries_is_checked() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        CodeMode([], max_retries=-1)


# ---------------------------------------------------------------------------- CLI usage errors


def test_cli_usage_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from jaild.cli import main

    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "MY_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert main(["codemode", "a task"]) == 2
    assert "set OPENAI_API_KEY" in capsys.readouterr().err
    assert main(["codemode", "a task", "--api-key-env", "MY_KEY"]) == 2
    assert "set MY_KEY" in capsys.readouterr().err
    broken = tmp_path / "tools.py"
    broken.write_text("def f(:\n")
    assert main(["codemode", "a task", "--tools", str(broken)]) == 2
    assert "cannot load tools" in capsys.readouterr().err
    assert main(["codemode", "a task", "--max-retries", "-1", "--base-url", "http://x/v1"]) == 2


def test_the_langchain_export_names_the_extra_when_langchain_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from jaild import extras

    assert CodeMode([search]).as_langchain_tool().name  # the control: installed here
    monkeypatch.setitem(extras.EXTRAS, "langchain", ("jaild_test_no_such_module",))
    with pytest.raises(ImportError, match=r"^as_langchain_tool\(\) needs jaild\[langchain\]: "
                                          r"pip install 'jaild\[langchain\]'$"):
        CodeMode([search]).as_langchain_tool()
