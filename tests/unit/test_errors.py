"""errors.py is the one home of jaild's exceptions and of the error -> exit status map."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

import jaild
from jaild import errors
from jaild.errors import (
    ERROR_CLASSES,
    EXIT_CODES,
    EXIT_FAILURE,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    BadRequest,
    Busy,
    ConfigError,
    ConnectionLost,
    DaemonUnavailable,
    EnvError,
    EnvUsageError,
    InternalError,
    JaildError,
    PermissionDenied,
    PolicyError,
    ProviderError,
    RemoteProtocolError,
    SessionClosed,
    ShuttingDown,
    StartupError,
    UnknownPolicy,
    UnsupportedVersion,
    error_line,
    exit_code_for,
)


def _modules() -> list[types.ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(jaild.__path__, "jaild.")
             if not m.name.endswith(".__main__")]  # importing it runs the CLI
    return [importlib.import_module(name) for name in ["jaild", *names]]


def exceptions_defined_outside_errors(modules: list[types.ModuleType]) -> list[str]:
    """Exception classes defined (not just imported) in a module other than jaild.errors."""
    return sorted(
        f"{module.__name__}.{name}"
        for module in modules
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
        and obj.__module__ == module.__name__ and module.__name__ != "jaild.errors"
    )


def test_every_exception_class_lives_in_errors_py() -> None:
    assert exceptions_defined_outside_errors(_modules()) == []


def test_an_exception_defined_elsewhere_is_found() -> None:
    stray = types.ModuleType("jaild.stray")
    exec("class Oops(ValueError):\n    pass\nfrom jaild.errors import BadRequest\n", vars(stray))
    assert exceptions_defined_outside_errors([stray]) == ["jaild.stray.Oops"]


@pytest.mark.parametrize(("error", "status"), [
    (DaemonUnavailable("no daemon"), EXIT_UNAVAILABLE),
    (ConnectionLost("gone"), EXIT_UNAVAILABLE),
    (ShuttingDown("bye"), EXIT_UNAVAILABLE),
    (RemoteProtocolError("garbage"), EXIT_UNAVAILABLE),
    (UnsupportedVersion("v9"), EXIT_UNAVAILABLE),
    (UnknownPolicy("nope"), EXIT_REFUSED),
    (BadRequest("too big"), EXIT_REFUSED),
    (PermissionDenied("no"), EXIT_REFUSED),
    (Busy("later"), EXIT_REFUSED),
    (SessionClosed("ended"), EXIT_REFUSED),
    (InternalError("bug"), EXIT_REFUSED),
    (PolicyError("f.toml", "limits.x", "bad"), EXIT_REFUSED),
    (ProviderError("cannot start"), EXIT_FAILURE),
    (ConfigError("servers.json", "mcpServers", "bad"), EXIT_USAGE),
    (EnvError("pip failed"), EXIT_FAILURE),
    (EnvUsageError("bad name"), EXIT_USAGE),
    (StartupError("no cgroups"), EXIT_FAILURE),  # front ends report it as DaemonUnavailable
    (KeyError("x"), EXIT_FAILURE),
])
def test_the_exit_status_of_each_error(error: Exception, status: int) -> None:
    assert exit_code_for(error) == status


def test_every_wire_error_has_a_deliberate_exit_status() -> None:
    """Each wire class resolves through the map to refused or unavailable, nothing else."""
    for cls in ERROR_CLASSES.values():
        assert exit_code_for(cls("m")) in (EXIT_REFUSED, EXIT_UNAVAILABLE), cls
    assert all(issubclass(cls, Exception) for cls in EXIT_CODES)


def test_env_errors_carry_their_exit_status() -> None:
    assert (EnvError("x").exit_code, EnvUsageError("x").exit_code) == (EXIT_FAILURE, EXIT_USAGE)


def test_error_line() -> None:
    assert error_line(DaemonUnavailable("no jaild daemon at /s")) == "no jaild daemon at /s"
    assert error_line(UnknownPolicy("no policy 'x'")) == "unknown_policy: no policy 'x'"


def test_local_errors_have_no_wire_code() -> None:
    """Only coded errors are JaildError; the local ones keep the builtin base callers use."""
    local = [
        obj for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
        and not issubclass(obj, JaildError)
    ]
    assert len(local) == 31, sorted(c.__name__ for c in local)
    for cls in local:
        assert not hasattr(cls, "code"), cls
