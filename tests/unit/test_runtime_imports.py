"""The in-jail runtime imports only what it may: stdlib, msgpack, pyseccomp, prctl, jaild.protocol."""

from __future__ import annotations

import json
import subprocess
import sys

from jaild.daemon.staging import RUNTIME_FILES

ALLOWED_THIRD_PARTY = {"msgpack", "pyseccomp", "prctl", "_prctl"}
ALLOWED_JAILD = {"jaild", "jaild.errors", "jaild.protocol", "jaild.runtime"}


def test_runtime_imports_nothing_else() -> None:
    probe = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import jaild.runtime.main, jaild.runtime.execute, jaild.runtime.tools, "
        "jaild.runtime.channel, jaild.runtime.harden, jaild.runtime.seccomp, jaild.runtime.files\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    stdlib = set(sys.stdlib_module_names)
    for name in loaded:
        top = name.split(".")[0]
        if top in stdlib:
            continue
        if top in ALLOWED_THIRD_PARTY or top.startswith(("_cython_", "cython_runtime")):
            continue  # msgpack's C extension brings its Cython runtime
        assert top == "jaild", f"the runtime imported {name}"
        assert any(name == a or name.startswith(a + ".") for a in ALLOWED_JAILD), name


def test_only_the_runtime_is_staged_into_jails() -> None:
    assert set(RUNTIME_FILES) == {"__init__.py", "errors.py", "protocol", "runtime"}


def test_jaild_package_import_is_lazy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, jaild; print('jaild.client' in sys.modules, 'jaild.daemon.server' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["False", "False"]
