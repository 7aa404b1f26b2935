"""Run by tests/unit/test_manifests.py in the tools venv (cel-python): evaluate the example
ValidatingAdmissionPolicy's CEL (its variables, then each validation) against the pods given
as JSON on stdin -- ``{"name": pod, ...}`` -- and print, as JSON, the messages of the
validations each pod fails. No API server can run here; this is the policy's own expressions
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
    checks = [(v["message"], env.program(env.compile(v["expression"])))
              for v in spec["validations"]]
    out: dict[str, list[str]] = {}
    for name, pod in json.load(sys.stdin).items():
        activation: dict[str, Any] = {"object": celpy.json_to_cel(pod)}
        variables = celpy.celtypes.MapType({})
        for var, program in variables_src:
            value = program.evaluate({**activation, "variables": variables})
            variables = celpy.celtypes.MapType(
                {**variables, celpy.celtypes.StringType(var): value})
        out[name] = [message for message, program in checks
                     if not bool(program.evaluate({**activation, "variables": variables}))]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
