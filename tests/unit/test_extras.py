"""The extras: which part needs which, said in one line when missing (jaild/extras.py).

The install without extras, end to end, is tests/integration/test_lean_install.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from jaild import extras
from jaild.cli import main
from jaild.errors import EXIT_FAILURE, MissingExtra, exit_code_for

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_each_extra_named_at_run_time_is_an_extra_of_the_package() -> None:
    declared = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)
    for name in extras.EXTRAS:
        assert declared[name], name


def test_the_base_install_brings_no_front_end_of_an_extra() -> None:
    base = {_distribution(r) for r in PYPROJECT["project"]["dependencies"]}
    for name in extras.EXTRAS:
        brought = {_distribution(r) for r in PYPROJECT["project"]["optional-dependencies"][name]}
        assert not brought & base, f"[{name}] is in the base install too: {brought & base}"
    assert {"openai", "mcp"} & base == set()


def test_every_extra_is_installed_in_the_dev_venv() -> None:
    # make setup installs them all (VENV_EXTRAS), so the controls below mean something
    for name in extras.EXTRAS:
        assert extras.installed(name), name


def test_a_missing_extra_is_one_line_naming_the_pip_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    extras.require("mcp", "jaild mcp")  # the control
    monkeypatch.setitem(extras.EXTRAS, "mcp", ("jaild_test_no_such_module",))
    with pytest.raises(MissingExtra) as caught:
        extras.require("mcp", "jaild mcp")
    assert caught.value.message == "jaild mcp needs jaild[mcp]: pip install 'jaild[mcp]'"
    assert isinstance(caught.value, ImportError)
    assert exit_code_for(caught.value) == EXIT_FAILURE


def test_a_dotted_module_whose_parent_is_missing_counts_as_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRAS, "otel", ("jaild_test_no_such_module.sdk",))
    assert not extras.installed("otel")


@pytest.mark.parametrize(("argv", "extra", "line"), [
    (["mcp"], "mcp", "jaild mcp needs jaild[mcp]: pip install 'jaild[mcp]'"),
    (["codemode", "a task"], "codemode",
     "jaild codemode needs jaild[codemode]: pip install 'jaild[codemode]'"),
])
def test_a_front_end_without_its_extra_says_so_and_exits_non_zero(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], extra: str, line: str) -> None:
    monkeypatch.setitem(extras.EXTRAS, extra, ("jaild_test_no_such_module",))
    assert main(argv) == EXIT_FAILURE
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")
