"""The import layering of jaild, checked from the source.

Every ``import`` in every module of the package is read with :mod:`ast`, those inside
functions, methods and ``try`` blocks included, so a lazy import cannot slip past.
The rules (issue 13, "Done when"):

1. ``jaild.errors`` imports only the standard library: it is staged into every jail.
2. ``jaild.protocol`` imports nothing of jaild but ``jaild.errors``.
3. ``jaild.runtime`` (the code that runs in the jail) imports no daemon or client code:
   of jaild only ``jaild``, ``jaild.errors``, ``jaild.protocol`` and ``jaild.runtime``;
   of the rest only the standard library, msgpack, pyseccomp and prctl.
4. The client (:data:`CLIENT`) imports no daemon code and no front end.
5. The pure modules (:data:`PURE_MODULES`, those of them that exist) do no IO.
6. ``prctl``, ``pyseccomp``, ``uvloop``, ``opentelemetry`` and ``ahocorasick`` are each
   imported by exactly one module, their wrapper (``opentelemetry``: ``jaild.tracing``, so that jaild runs
   without the ``[otel]`` extra).
7. No two modules import each other (as ``jaild.cli`` and ``jaild.codemode`` did), the
   package's lazy public API in ``jaild/__init__.py`` excepted; and no module imports
   ``jaild`` itself (``from jaild import __version__`` was such an arrow back up to the
   ``__init__`` that imports it: the version is ``jaild.version``'s); and ``jaild.cli`` is
   the top: only ``jaild.__main__`` and ``jaild.cli_reference`` import it, so no front end
   it registers (``jaild.codemode``) imports it back.
8. ``jaild.testing`` (the fake launcher and daemon) is imported by no module of the
   package: what serves real jobs cannot come to depend on what isolates nothing.
9. The daemon's wings (:data:`WINGS`: the pure core, jail making, egress, observability,
   the state kept on disk) import nothing of the shell around them (``jaild.daemon``'s own modules: the server,
   start-up, the pipeline, sessions, placement, the registry, configuration, ...). Every
   module of ``jaild.daemon.core`` is pure (rule 5) without being listed, so the core does
   no IO and imports no other wing.

"No IO", precisely: a pure module can neither act on nor observe anything outside its
arguments and the interpreter's memory -- files, pipes, sockets, processes, signals,
terminals, threads, event loops, the clock, the log. Statically that is:

* it imports none of :data:`IO_MODULES` (nor a submodule of one, such as ``os.path``);
* it calls none of :data:`IO_BUILTINS` (``open``, ``print``, ...) and touches neither
  ``sys.stdin``, ``sys.stdout`` nor ``sys.stderr``;
* of ``jaild.daemon`` it imports only other pure modules, and it imports no client or
  front end, so the IO cannot come in through a neighbour either.

Imports under ``if TYPE_CHECKING:`` never run; the purity rule ignores them (the
others do not: a type-only dependency on the daemon is still a dependency).

Each rule is a function from the parsed package to a list of violations. The real
package must give none; a synthetic module that breaks the rule (the positive control)
must give one, so a rule that can no longer fail is noticed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaild.daemon.jails.staging import RUNTIME_FILES

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "jaild"

PURE_MODULES = (
    "jaild.errors",
    "jaild.protocol.connection",
    "jaild.protocol.fields",
    "jaild.protocol.framing",
    "jaild.protocol.messages",
    "jaild.protocol.records",
    "jaild.protocol.zygote_link",
    "jaild.policy.compile",
    "jaild.policy.egress",
    "jaild.policy.flow",
    "jaild.policy.redact",
    "jaild.daemon.core.machine",
    "jaild.daemon.core.broker",
    "jaild.daemon.core.classify",
    "jaild.daemon.core.admission",
    "jaild.daemon.core.records",
    "jaild.daemon.core.peer",
    "jaild.daemon.core.readiness",
    "jaild.daemon.core.session",
    "jaild.daemon.core.parked",
)
"""Modules that must do no IO. Several are being written as this test is; the rule
checks those that exist, and :func:`test_most_pure_modules_exist` keeps the list honest."""

IO_MODULES = frozenset({
    "asyncio", "socket", "ssl", "subprocess", "os", "io", "shutil", "tempfile", "mmap",
    "threading", "_thread", "multiprocessing", "concurrent", "select", "selectors",
    "signal", "ctypes", "fcntl", "termios", "pty", "time", "logging", "importlib",
    "builtins",
})
"""Importing any of these (or a submodule) is IO, or a way around this check."""

IO_BUILTINS = frozenset({"open", "print", "input", "breakpoint", "__import__"})
STD_STREAMS = frozenset({"stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__"})

CLIENT = ("jaild.client", "jaild.fleet", "jaild.transfer", "jaild.toolspec", "jaild.address",
          "jaild.loops", "jaild.tracing", "jaild.transport", "jaild.toolhost", "jaild.blocking",
          "jaild.version")
FRONT_ENDS = ("jaild.cli", "jaild.codemode", "jaild.mcp_server", "jaild.envs")

RUNTIME_JAILD = ("jaild.errors", "jaild.protocol", "jaild.runtime")
RUNTIME_THIRD_PARTY = frozenset({"msgpack", "pyseccomp", "prctl", "cloudpickle"})

WRAPPERS = {
    "prctl": ("jaild.runtime.harden", frozenset({"prctl", "_prctl"})),
    "pyseccomp": ("jaild.runtime.seccomp", frozenset({"pyseccomp", "seccomp"})),
    "cloudpickle": ("jaild.runtime.snapshot", frozenset({"cloudpickle"})),
    "uvloop": ("jaild.loops", frozenset({"uvloop"})),
    "opentelemetry": ("jaild.tracing", frozenset({"opentelemetry"})),
    "pyahocorasick": ("jaild.policy.redact", frozenset({"ahocorasick"})),
}
"""Foreign package -> (the one module that may import it, the names it goes by)."""

STDLIB = frozenset(sys.stdlib_module_names)


# ----------------------------------------------------------------------------- the parser


@dataclass(frozen=True)
class Import:
    """One imported module: its absolute dotted name, where, and whether it only runs
    for the type checker."""

    name: str
    line: int
    type_checking: bool


@dataclass(frozen=True)
class Module:
    name: str
    imports: tuple[Import, ...]
    io_calls: tuple[tuple[str, int], ...]  # (what, line): IO builtins and std streams

    def imported(self, *, runtime_only: bool = False) -> Iterator[Import]:
        return (i for i in self.imports if not (runtime_only and i.type_checking))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _within(prefix: str, name: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def parse(name: str, source: str, *, is_package: bool = False,
          known: frozenset[str] = frozenset()) -> Module:
    """Parse one module. ``known``: the package's module names, to tell ``from jaild
    import client`` (a module) from ``from jaild import __version__`` (an attribute)."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    imports: list[Import] = []
    io_calls: list[tuple[str, int]] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            imports.extend(Import(a.name, node.lineno, type_checking) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                imports.append(Import(sub if sub in known else base, node.lineno, type_checking))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in IO_BUILTINS:
                io_calls.append((f"{func.id}()", node.lineno))
        elif (isinstance(node, ast.Attribute) and node.attr in STD_STREAMS
              and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            io_calls.append((f"sys.{node.attr}", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    return Module(name, tuple(imports), tuple(io_calls))


def load_package(root: Path = PACKAGE_DIR) -> dict[str, Module]:
    """Every module of the package, by dotted name."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    known = frozenset(files)
    return {
        name: parse(name, path.read_text(encoding="utf-8"), is_package=is_package, known=known)
        for name, (path, is_package) in files.items()
    }


# ----------------------------------------------------------------------------- the rules

Rule = Callable[[Mapping[str, Module]], list[str]]


def _in(modules: Mapping[str, Module], prefix: str) -> Iterator[Module]:
    return (m for name, m in sorted(modules.items()) if _within(prefix, name))


def errors_imports_only_the_stdlib(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{m.name}:{i.line} imports {i.name}"
        for m in _in(modules, "jaild.errors") for i in m.imported()
        if i.name.split(".")[0] not in STDLIB
    ]


def protocol_imports_only_errors(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{m.name}:{i.line} imports {i.name}"
        for m in _in(modules, "jaild.protocol") for i in m.imported()
        if _within("jaild", i.name)
        and not (_within("jaild.protocol", i.name) or i.name == "jaild.errors")
    ]


def runtime_imports_no_daemon_or_client(modules: Mapping[str, Module]) -> list[str]:
    out = []
    for m in _in(modules, "jaild.runtime"):
        for i in m.imported():
            top = i.name.split(".")[0]
            if top == "jaild":
                ok = i.name == "jaild" or any(_within(p, i.name) for p in RUNTIME_JAILD)
            else:
                ok = top in STDLIB or top in RUNTIME_THIRD_PARTY or top in WRAPPERS["prctl"][1]
            if not ok:
                out.append(f"{m.name}:{i.line} imports {i.name}")
    return out


def client_imports_no_daemon(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{name}:{i.line} imports {i.name}"
        for name in CLIENT if name in modules
        for i in modules[name].imported()
        if _within("jaild.daemon", i.name) or any(_within(f, i.name) for f in FRONT_ENDS)
    ]


def pure_modules_do_no_io(modules: Mapping[str, Module]) -> list[str]:
    out = []
    pure = {*PURE_MODULES, *(name for name in modules if _within(CORE, name))}
    for name in sorted(pure):
        if name not in modules:
            continue
        m = modules[name]
        for i in m.imported(runtime_only=True):
            if i.name.split(".")[0] in IO_MODULES:
                out.append(f"{name}:{i.line} imports {i.name}")
            elif (_within("jaild.daemon", i.name) and i.name not in pure) or any(
                _within(p, i.name) for p in CLIENT + FRONT_ENDS
            ):
                out.append(f"{name}:{i.line} imports {i.name}, which is not pure")
        out += [f"{name}:{line} calls {what}" for what, line in m.io_calls]
    return out


def foreign_packages_have_one_wrapper(modules: Mapping[str, Module]) -> list[str]:
    out = []
    for package, (wrapper, names) in WRAPPERS.items():
        importers = sorted(
            m.name for m in modules.values()
            if any(i.name.split(".")[0] in names for i in m.imported())
        )
        if importers != [wrapper]:
            out.append(f"{package} is imported by {importers}; only {wrapper} may")
    return out


def no_two_modules_import_each_other(modules: Mapping[str, Module]) -> list[str]:
    uses = {
        name: {i.name for i in m.imported() if i.name in modules and i.name != name}
        for name, m in modules.items() if name != "jaild"
    }
    return [
        f"{a} and {b} import each other"
        for a in sorted(uses) for b in sorted(uses[a]) if a < b and a in uses.get(b, ())
    ]


def nothing_imports_the_package_itself(modules: Mapping[str, Module]) -> list[str]:
    """``import jaild`` or ``from jaild import NAME`` (an attribute, not a module) in a
    module of jaild: an arrow back up to ``jaild/__init__.py``, which imports the modules."""
    return [
        f"{m.name}:{i.line} imports jaild itself"
        for name, m in sorted(modules.items()) if name != "jaild"
        for i in m.imported() if i.name == "jaild"
    ]


CLI_IMPORTERS = ("jaild.__main__", "jaild.cli_reference")
"""The only modules that import ``jaild.cli``: ``python -m jaild``, and the reference page
written from its parser. The CLI is the top of the graph: it registers the other front
ends' commands (``jaild.codemode``, ``jaild.mcp_server``, ``jaild.envs``), none of which
imports it back (``jaild.codemode`` did: the circle); what they share lives below them
(``jaild.address``, ``jaild.providers``, ``jaild.errors``)."""


def nothing_imports_the_cli(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{m.name}:{i.line} imports {i.name}"
        for name, m in sorted(modules.items())
        if not _within("jaild.cli", name) and name not in CLI_IMPORTERS
        for i in m.imported() if _within("jaild.cli", i.name)
    ]


CORE = "jaild.daemon.core"
WINGS = (CORE, "jaild.daemon.jails", "jaild.daemon.egress", "jaild.daemon.observe",
         "jaild.daemon.state")
"""The daemon's sub-packages below its shell (``jaild/daemon/__init__.py`` says what each
holds); the shell is ``jaild.daemon``'s own modules."""


def _shell(name: str) -> bool:
    return (_within("jaild.daemon", name) and name != "jaild.daemon"
            and not any(_within(wing, name) for wing in WINGS))


def no_wing_imports_the_shell(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{m.name}:{i.line} imports {i.name}, of the shell"
        for m in modules.values() if any(_within(wing, m.name) for wing in WINGS)
        for i in m.imported() if _shell(i.name)
    ]


def nothing_imports_testing(modules: Mapping[str, Module]) -> list[str]:
    return [
        f"{m.name}:{i.line} imports {i.name}"
        for m in modules.values() if not _within("jaild.testing", m.name)
        for i in m.imported() if _within("jaild.testing", i.name)
    ]


RULES: dict[str, Rule] = {
    "errors": errors_imports_only_the_stdlib,
    "protocol": protocol_imports_only_errors,
    "runtime": runtime_imports_no_daemon_or_client,
    "client": client_imports_no_daemon,
    "pure": pure_modules_do_no_io,
    "wrappers": foreign_packages_have_one_wrapper,
    "mutual": no_two_modules_import_each_other,
    "package": nothing_imports_the_package_itself,
    "cli": nothing_imports_the_cli,
    "testing": nothing_imports_testing,
    "wings": no_wing_imports_the_shell,
}


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    return load_package()


@pytest.mark.parametrize("rule", list(RULES))
def test_the_package_keeps_the_rule(package: dict[str, Module], rule: str) -> None:
    assert RULES[rule](package) == []


def _with(package: Mapping[str, Module], name: str, source: str) -> dict[str, Module]:
    """The package plus (or with ``name`` replaced by) a synthetic module."""
    known = frozenset(package) | {name}
    return {**package, name: parse(name, source, known=known)}


BREAKERS = [
    ("errors", "jaild.errors", "import msgpack\n"),
    ("errors", "jaild.errors", "def later():\n    from jaild.protocol import pack\n"),
    ("protocol", "jaild.protocol.evil", "def f():\n    from jaild.daemon.jails import job\n"),
    ("protocol", "jaild.protocol.evil", "from jaild import __version__\n"),
    ("protocol", "jaild.protocol.evil", "from .. import client\n"),
    ("runtime", "jaild.runtime.evil", "try:\n    import jaild.daemon.server\nexcept ImportError:\n    pass\n"),
    ("runtime", "jaild.runtime.evil", "class C:\n    def m(self):\n        from jaild.client import Client\n"),
    ("runtime", "jaild.runtime.evil", "import jsonschema\n"),
    ("client", "jaild.transfer", "from jaild.daemon.config import socket_from_env\n"),
    ("client", "jaild.client", "def f():\n    from jaild import cli\n"),
    ("client", "jaild.toolspec", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaild.daemon.jails.job import JobSpec\n"),
    ("pure", "jaild.policy.compile", "def f():\n    import os.path\n"),
    ("pure", "jaild.policy.compile", "from asyncio import sleep\n"),
    ("pure", "jaild.policy.compile", "def f(p):\n    with open(p) as fh:\n        return fh.read()\n"),
    ("pure", "jaild.policy.compile", "import sys\ndef f():\n    sys.stderr.write('x')\n"),
    ("pure", "jaild.policy.compile", "def f():\n    print('x')\n"),
    ("pure", "jaild.policy.compile", "import time\n"),
    ("pure", "jaild.policy.compile", "from jaild.daemon.jails.job import JailedJob\n"),
    ("pure", "jaild.policy.compile", "import importlib\nm = importlib.import_module('socket')\n"),
    # the information-flow rules (ARCHITECTURE.md: pure)
    ("pure", "jaild.policy.flow", "import asyncio\n"),
    ("pure", "jaild.policy.flow", "def f():\n    import os\n    return os.environ\n"),
    ("wrappers", "jaild.runtime.evil", "def f():\n    import prctl\n"),
    ("wrappers", "jaild.daemon.evil", "from seccomp import SyscallFilter\n"),
    ("wrappers", "jaild.runtime.harden", "x = 1\n"),  # the wrapper no longer wraps it
    ("wrappers", "jaild.daemon.evil", "def f():\n    from opentelemetry.trace import get_tracer\n"),
    ("runtime", "jaild.runtime.evil", "def f():\n    import opentelemetry.trace\n"),
    ("client", "jaild.tracing", "from jaild.daemon.jails.job import JailedJob\n"),
    ("client", "jaild.toolhost", "def f():\n    from jaild.mcp_server import McpServer\n"),
    ("client", "jaild.blocking", "from jaild.daemon import private\n"),
    ("mutual", "jaild.codemode", "def f():\n    from jaild.cli import main\n"),
    ("package", "jaild.client", "from jaild import __version__\n"),
    ("package", "jaild.daemon.evil", "def f():\n    import jaild\n"),
    ("package", "jaild.fleet", "from . import __version__\n"),
    ("cli", "jaild.codemode", "def f():\n    from jaild.cli import main\n"),
    ("cli", "jaild.mcp_server", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaild import cli\n"),
    ("testing", "jaild.daemon.jails.job", "from jaild.testing import FakeLauncher\n"),
    ("testing", "jaild.client", "def f():\n    import jaild.testing\n"),
    ("wings", "jaild.daemon.jails.evil", "from jaild.daemon.server import Daemon\n"),
    ("wings", "jaild.daemon.observe.evil", "def f():\n    from jaild.daemon import startup\n"),
    ("wings", "jaild.daemon.core.evil", "from jaild.daemon.config import DaemonConfig\n"),
    ("wings", "jaild.daemon.state.evil", "from jaild.daemon.sessions import Sessions\n"),
    ("wings", "jaild.daemon.state.parkedruns",
     "def f():\n    from jaild.daemon.approvals import DurableRun\n"),
    # each machine of the core, named (item: the session's and the parked run's)
    ("pure", "jaild.daemon.core.session", "import asyncio\n"),
    ("pure", "jaild.daemon.core.session", "from jaild.daemon.sessions import Sessions\n"),
    ("pure", "jaild.daemon.core.parked", "import os\n"),
    ("pure", "jaild.daemon.core.parked", "from jaild.daemon.approvals import DurableRun\n"),
    ("pure", "jaild.daemon.core.readiness", "import time\n"),
    ("mutual", "jaild.daemon.state.parkedruns",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaild.daemon.approvals import DurableRun\n"),
    # a module of the core is pure without being listed: no IO, no other wing
    ("pure", "jaild.daemon.core.evil", "import socket\n"),
    ("pure", "jaild.daemon.core.evil", "from jaild.daemon.jails import job\n"),
    ("pure", "jaild.daemon.core.evil", "from jaild.daemon.observe.metrics import Metrics\n"),
]


@pytest.mark.parametrize(("rule", "name", "source"), BREAKERS)
def test_each_rule_catches_a_module_that_breaks_it(
    package: dict[str, Module], rule: str, name: str, source: str
) -> None:
    assert RULES[rule](package) == []
    found = RULES[rule](_with(package, name, source))
    assert found, f"rule {rule!r} missed {name}: {source!r}"
    assert any(name in v for v in found), found


def test_every_rule_has_a_positive_control() -> None:
    assert {rule for rule, _, _ in BREAKERS} == set(RULES)


def test_type_checking_imports_do_not_count_as_io(package: dict[str, Module]) -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncio\n"
    assert pure_modules_do_no_io(_with(package, "jaild.policy.compile", source)) == []


def test_most_pure_modules_exist(package: dict[str, Module]) -> None:
    """The rule checks the pure modules that exist; a list of names that all went missing
    (renamed, say) would check nothing."""
    present = [name for name in PURE_MODULES if name in package]
    assert len(present) >= 6, present


def test_the_parser_sees_every_kind_of_import() -> None:
    known = frozenset({"jaild", "jaild.runtime", "jaild.runtime.files", "jaild.errors"})
    m = parse("jaild.runtime.x", (
        "import a.b as c, d\n"
        "from . import files\n"
        "from .. import errors\n"
        "from jaild import __version__\n"
        "def f():\n"
        "    import e\n"
        "class K:\n"
        "    def g(self):\n"
        "        from f.g import h\n"
        "try:\n"
        "    import i\n"
        "except ImportError:\n"
        "    import j\n"
        "if TYPE_CHECKING:\n"
        "    import k\n"
        "else:\n"
        "    import l\n"
    ), known=known)
    assert [(i.name, i.type_checking) for i in m.imports] == [
        ("a.b", False), ("d", False), ("jaild.runtime.files", False), ("jaild.errors", False),
        ("jaild", False), ("e", False), ("f.g", False), ("i", False), ("j", False),
        ("k", True), ("l", False),
    ]


# ------------------------------------------------ the runtime, as it really loads (was test_runtime_imports.py)


def test_runtime_imports_nothing_else_when_loaded() -> None:
    """Rule 3 again, from what a real import of the runtime loads (transitively)."""
    probe = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        "import jaild.runtime.main, jaild.runtime.execute, jaild.runtime.tools, "
        "jaild.runtime.channel, jaild.runtime.harden, jaild.runtime.seccomp, jaild.runtime.files\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    allowed_third_party = RUNTIME_THIRD_PARTY | {"_prctl"}
    for name in loaded:
        top = name.split(".")[0]
        if top in STDLIB:
            continue
        if top in allowed_third_party or top.startswith(("_cython_", "cython_runtime")):
            continue  # msgpack's C extension brings its Cython runtime
        assert top == "jaild", f"the runtime imported {name}"
        assert name == "jaild" or any(_within(a, name) for a in RUNTIME_JAILD), name


def test_only_the_runtime_is_staged_into_jails() -> None:
    assert set(RUNTIME_FILES) == {"__init__.py", "errors.py", "protocol", "runtime"}


def test_jaild_package_import_is_lazy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, jaild; print('jaild.client' in sys.modules, 'jaild.daemon.server' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["False", "False"]


def test_the_staged_runtime_is_the_packages() -> None:
    """staging.py finds the runtime from where it stands in the package: moved, it would
    look in the wrong directory (and the daemon would not start)."""
    from jaild.daemon.jails.staging import PACKAGE_DIR, _runtime_sources

    assert Path(__file__).resolve().parents[2] / "jaild" == PACKAGE_DIR
    assert PACKAGE_DIR / "runtime" / "main.py" in _runtime_sources()
