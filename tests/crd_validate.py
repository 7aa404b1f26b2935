"""Run by tests/unit/test_manifests.py in the tools venv (jsonschema, PyYAML): validate the
custom resources in YAML files against vendored CRD schemas (tests/schemas/<project>/*.json:
each a CRD version's openAPIV3Schema, pinned to a release), strictly -- an unknown field
fails, as the API server's strict field validation (kubectl's default) would refuse it
rather than prune it. Prints, as JSON, ``[[kind, name, [error, ...]], ...]``: one entry per
custom resource, every one of a kind no vendored schema covers failing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"


def strict(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main() -> None:
    schemas = {}
    for path in sorted(SCHEMAS.glob("*/*.json")):
        vendored = json.loads(path.read_text())
        schemas[(vendored["apiVersion"], vendored["kind"])] = strict(vendored["schema"])
    out = []
    for name in sys.argv[1:]:
        with open(name) as f:
            for doc in yaml.safe_load_all(f):
                if not doc or "." not in doc["apiVersion"].split("/")[0] or \
                        doc["apiVersion"].split("/")[0].endswith(".k8s.io"):
                    continue  # built in: kubernetes-validate's
                key = (doc["apiVersion"], doc["kind"])
                if key not in schemas:
                    out.append([doc["kind"], doc["metadata"]["name"],
                                [f"no vendored schema for {key[0]} {key[1]}"]])
                    continue
                validator = jsonschema.Draft7Validator(schemas[key])
                errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                          for e in validator.iter_errors(doc)]
                out.append([doc["kind"], doc["metadata"]["name"], errors])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
