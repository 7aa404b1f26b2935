"""Run by tests/unit/test_manifests.py in the tools venv (cel-python): evaluate a
ValidatingAdmissionPolicy's CEL (its variables, then each validation) against the objects
given as JSON on stdin -- ``{"name": object, ...}``, where an entry that is
``{"object": ..., "request": ...}`` gives the admission request too (``request.namespace``,
``request.userInfo``) -- and print, as JSON, the messages of the validations each fails
(a ``messageExpression``'s, evaluated). No API server can run here; this is the policy's own expressions
evaluated by a CEL implementation, as an API server would."""

from __future__ import annotations

import json
import sys
from typing import Any

import celpy
import yaml


def main() -> None:
    policy_path, = sys.argv[1:]
    with open(policy_path) as f:
        spec = next(d for d in yaml.safe_load_all(f)
                    if d and d.get("kind") == "ValidatingAdmissionPolicy")["spec"]
    env = celpy.Environment()
    variables_src = [(v["name"], env.program(env.compile(v["expression"])))
                     for v in spec.get("variables", [])]
    checks = [(v.get("message", ""),
               env.program(env.compile(v["messageExpression"]))
               if "messageExpression" in v else None,
               env.program(env.compile(v["expression"])))
              for v in spec["validations"]]
    out: dict[str, list[str]] = {}
    for name, given in json.load(sys.stdin).items():
        if "object" in given:
            activation: dict[str, Any] = {"object": celpy.json_to_cel(given["object"]),
                                          "request": celpy.json_to_cel(given["request"])}
        else:  # a pod alone
            activation = {"object": celpy.json_to_cel(given)}
        variables = celpy.celtypes.MapType({})
        for var, program in variables_src:
            value = program.evaluate({**activation, "variables": variables})
            variables = celpy.celtypes.MapType(
                {**variables, celpy.celtypes.StringType(var): value})
        context = {**activation, "variables": variables}
        out[name] = [str(expression.evaluate(context)) if expression is not None else message
                     for message, expression, program in checks
                     if not bool(program.evaluate(context))]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
