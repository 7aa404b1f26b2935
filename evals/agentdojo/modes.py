"""The policies a run serves: each suite's policy in three modes (pure: text in, text out).

* ``on``: the suite's policy as written (``evals/agentdojo/policies/SUITE.toml``);
* ``off``: the same policy with its ``[flow]`` tables removed -- the control, what an attacker
  gets from the same jail without information-flow control;
* ``approve``: the same policy with ``flow.on_untrusted = "approve"``: a protected call by a
  job holding untrusted data waits for the client's approve callback instead of being refused.
* ``plan``: the suite's policy *with* its ``[[flow.plan]]`` tables (``on`` and ``approve``
  leave them out): the job plans its protected calls before it reads untrusted data
  (replay.py's ``plan_code``), and a call after the taint goes through by an intent.
* ``exact``: as ``plan``, with every plan's ``free`` list emptied: an intent pins every
  argument (the strictest plan, sound against any attacker choice of argument).
* ``open``, ``open_exact``, ``open_plan``: as ``on``, ``exact``, ``plan``, without the
  ``[[flow.sink]]`` tables: the result and the output reach the caller whatever the job
  read (the design before the sinks: it guards the calls, not the answer).

The policies are TOML; stdlib ``tomllib`` reads them and the ``[flow]`` tables are written
back by :func:`flow_toml` (strings, numbers, booleans and arrays of them are all a flow table
holds), so a variant differs from the suite's file in ``[flow]`` alone, and each variant is
read back and compared with what it should be.
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any, Literal

Mode = Literal["on", "off", "approve", "plan", "exact", "open", "open_exact", "open_plan"]
MODES: tuple[Mode, ...] = ("on", "off", "approve", "plan", "exact", "open", "open_exact",
                           "open_plan")


def planning(mode: Mode) -> bool:
    """Does a job of ``mode`` plan (``tools.intend``) before it reads untrusted data?"""
    return mode in ("plan", "exact", "open_plan", "open_exact")

_HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\"' -]+?)\s*\]\]?\s*(?:#.*)?$")


def policy_name(suite: str, mode: Mode) -> str:
    """The name the daemon serves ``suite``'s policy under in ``mode``."""
    return f"agentdojo-{suite}" if mode == "on" else f"agentdojo-{suite}-{mode}"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ValueError(f"a [flow] value of type {type(value).__name__} is not written: {value!r}")


def flow_toml(flow: dict[str, Any]) -> str:
    """``flow`` (a parsed ``[flow]`` table) as TOML: its keys under ``[flow]``, its arrays
    of tables (``source``, ``sink``, ``guard``) as ``[[flow.NAME]]`` tables."""
    lines = ["[flow]"]
    tables: list[str] = []
    for key, value in flow.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for table in value:
                tables.append(f"\n[[flow.{key}]]")
                tables.extend(f"{k} = {_value(v)}" for k, v in table.items())
        elif isinstance(value, dict):
            raise ValueError(f"[flow] {key}: a table is not written")
        else:
            lines.append(f"{key} = {_value(value)}")
    return "\n".join(lines + tables) + "\n"


def without_flow(text: str) -> str:
    """``text`` (a policy) without its ``[flow]`` tables, ``[flow]`` and ``[[flow.*]]``
    alike; every other line as it was."""
    out: list[str] = []
    in_flow = False
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(1).strip().strip("\"'")
            in_flow = name == "flow" or name.startswith("flow.")
        if not in_flow:
            out.append(line)
    stripped = "\n".join(out) + "\n"
    if "flow" in tomllib.loads(stripped):  # an inline `flow = {...}` before any table
        raise ValueError("the policy's [flow] is not in tables of its own; cannot remove it")
    return stripped


def variant(text: str, mode: Mode) -> str:
    """The suite's policy ``text`` in ``mode``.

    Raises:
        ValueError: the policy is not TOML, or the variant does not read back as it should.
    """
    policy = tomllib.loads(text)
    if mode == "plan":
        return text
    base = without_flow(text)
    if mode == "off":
        expected = {k: v for k, v in policy.items() if k != "flow"}
        made = base
    else:
        flow = dict(policy.get("flow", {}))
        if mode in ("exact", "open_exact"):
            flow["plan"] = [{**p, "free": []} for p in flow.get("plan", [])]
            if not flow["plan"]:
                del flow["plan"]
        elif mode != "open_plan":
            flow.pop("plan", None)
        if mode == "approve":
            flow["on_untrusted"] = "approve"
        if mode.startswith("open"):
            flow.pop("sink", None)
        expected = {**{k: v for k, v in policy.items() if k != "flow"}, "flow": flow}
        made = base + "\n" + flow_toml(flow)
    if tomllib.loads(made) != expected:
        raise ValueError(f"the {mode!r} variant does not read back as the policy in that mode")
    return made


def describe(mode: Mode) -> str:
    return {"on": "flow on (the suite's policy without its plans: job-granular integrity)",
            "off": "flow off (the policy without [flow]: the control)",
            "approve": 'flow on, on_untrusted = "approve" (every approval granted)',
            "plan": "plans (the suite's policy with its [[flow.plan]] tables; the job plans "
                    "before it reads untrusted data)",
            "exact": "exact plans (every plan's free list emptied: each intent pins every "
                     "argument)",
            "open": "flow on, the answer open (the policy without its [[flow.sink]] tables: "
                    "calls guarded, the result and output reach the caller)",
            "open_exact": "exact plans, the answer open",
            "open_plan": "plans, the answer open"}[mode]
