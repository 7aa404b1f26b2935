"""proto/PROTOCOL.md agrees with the code: messages, fields, structures, states, error codes.

The spec's tables are plain GitHub Markdown under ``### <name>`` headings; a ``|`` inside a
cell is written ``\\|``. A fields cell lists each field in backticks as ``name: type`` or
``name?: type = default`` (``?``: may be omitted; the default is a Python literal).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from jaild import errors
from jaild.daemon.job import STATUSES
from jaild.errors import ERROR_CLASSES, JaildError
from jaild.protocol import MESSAGES, PROTOCOL_VERSION, Role
from jaild.protocol import messages as messages_module
from jaild.protocol.connection import TRANSITIONS
from jaild.protocol.fields import Struct
from jaild.protocol.messages import Message

SPEC = Path(__file__).resolve().parents[2] / "proto" / "PROTOCOL.md"

Table = list[dict[str, str]]

_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_FIELD = re.compile(r"(?P<name>\w+)(?P<optional>\?)?: (?P<type>.+?)(?: = (?P<default>.+))?")


def parse_tables(text: str) -> dict[str, Table]:
    """Every table that sits directly under a ``###`` heading, keyed by the heading's text.

    Rows become dicts keyed by the header row's cells. A second table under one heading is
    an error, so a table cannot hide behind another.
    """
    tables: dict[str, Table] = {}
    heading: str | None = None
    header: list[str] | None = None
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("#"):
            heading = line[4:].strip() if line.startswith("### ") else None
            header = None
            continue
        if not line.startswith("|"):
            header = None
            continue
        if heading is None:
            continue
        cells = [c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(line.strip())[1:-1]]
        if header is None:
            assert heading not in tables, f"two tables under '### {heading}'"
            header = cells
            tables[heading] = []
        elif set("".join(cells)) <= set("-: "):
            continue  # the separator row
        else:
            assert len(cells) == len(header), f"'### {heading}': row {cells} vs header {header}"
            tables[heading].append(dict(zip(header, cells, strict=True)))
    return tables


def unquote(cell: str) -> str:
    assert cell.startswith("`") and cell.endswith("`"), f"expected `name`, got {cell!r}"
    return cell[1:-1]


@dataclasses.dataclass(frozen=True)
class DocField:
    name: str
    optional: bool
    type: str
    default: Any


_NO_DEFAULT = object()


def parse_fields(cell: str) -> list[DocField]:
    out = []
    for spec in re.findall(r"`([^`]+)`", cell):
        m = _FIELD.fullmatch(spec)
        assert m, f"cannot read field {spec!r}: write `name: type` or `name?: type = default`"
        default = m["default"]
        optional = m["optional"] is not None
        assert optional == (default is not None), f"{spec!r}: '?' and '= default' go together"
        out.append(DocField(m["name"], optional, m["type"],
                            ast.literal_eval(default) if optional else _NO_DEFAULT))
    return out


def code_fields(cls: type[Struct]) -> list[DocField]:
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        optional = f.name not in cls._required
        if not optional:
            default: Any = _NO_DEFAULT
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        out.append(DocField(f.name, optional, str(f.type), default))
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return SPEC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tables(text: str) -> dict[str, Table]:
    return parse_tables(text)


def _rows(tables: dict[str, Table], heading: str, *columns: str) -> Table:
    assert heading in tables, f"PROTOCOL.md has no table under '### {heading}'"
    rows = tables[heading]
    assert rows, f"'### {heading}' is empty"
    assert list(rows[0]) == list(columns), f"'### {heading}' columns {list(rows[0])}"
    return rows


def _check_fields_table(rows: Table, key: str, expected: dict[str, type[Struct]],
                        where: str) -> None:
    names = [unquote(r[key]) for r in rows]
    assert len(names) == len(set(names)), f"{where}: listed twice: {names}"
    assert sorted(names) == sorted(expected), f"{where}: spec {sorted(names)}, code {sorted(expected)}"
    for row in rows:
        name = unquote(row[key])
        doc = parse_fields(row["fields"])
        code = code_fields(expected[name])
        assert [f.name for f in doc] == [f.name for f in code], f"{where} {name}: field names"
        for d, c in zip(doc, code, strict=True):
            assert d.optional == c.optional, f"{where} {name}.{d.name}: optional in spec? {d.optional}"
            assert d.type == c.type, f"{where} {name}.{d.name}: spec says {d.type}, code {c.type}"
            assert d.default == c.default, f"{where} {name}.{d.name}: default {d.default!r}"


# --------------------------------------------------------------------------- the parser itself


def test_parser_reads_escaped_pipes_optional_fields_and_defaults() -> None:
    doc = (
        "## Section\n\n| ignored | table |\n|---|---|\n| a | b |\n\n"
        "### a -> b\n\n| message | fields |\n|---|---|\n"
        "| `M` | `x: int`, `y?: bytes \\| None = None`, `z?: str = \"<job>\"` |\n"
    )
    tables = parse_tables(doc)
    assert list(tables) == ["a -> b"]
    (row,) = tables["a -> b"]
    assert unquote(row["message"]) == "M"
    assert parse_fields(row["fields"]) == [
        DocField("x", False, "int", _NO_DEFAULT),
        DocField("y", True, "bytes | None", None),
        DocField("z", True, "str", "<job>"),
    ]


def test_parser_refuses_two_tables_under_one_heading() -> None:
    doc = "### h\n\n| a |\n|---|\n| 1 |\n\nprose\n\n| b |\n|---|\n| 2 |\n"
    with pytest.raises(AssertionError, match="two tables"):
        parse_tables(doc)


# --------------------------------------------------------------------------- the spec


def test_spec_states_this_protocol_version(text: str) -> None:
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in text
    assert text.splitlines()[0] == f"# jaild wire protocol, version {PROTOCOL_VERSION}"


@pytest.mark.parametrize("direction", list(MESSAGES))
def test_message_table_lists_exactly_the_messages_and_fields(tables: dict[str, Table],
                                                             direction: str) -> None:
    heading = direction.replace("->", " -> ")
    rows = _rows(tables, heading, "message", "fields")
    _check_fields_table(rows, "message", dict(MESSAGES[direction]), heading)  # type: ignore[index]


def test_structure_table_lists_every_nested_structure(tables: dict[str, Table]) -> None:
    structures = {
        obj.__name__: obj for obj in vars(messages_module).values()
        if isinstance(obj, type) and issubclass(obj, Struct)
        and not issubclass(obj, Message) and obj is not Struct
    }
    assert structures  # ToolSpec, ErrorInfo
    rows = _rows(tables, "structures", "structure", "fields")
    _check_fields_table(rows, "structure", structures, "structures")


def test_no_direction_table_is_extra(tables: dict[str, Table]) -> None:
    documented = {h for h, rows in tables.items() if rows and list(rows[0]) == ["message", "fields"]}
    assert documented == {d.replace("->", " -> ") for d in MESSAGES}


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_state_machine_table_is_the_transition_table(tables: dict[str, Table],
                                                     role: Role) -> None:
    rows = _rows(tables, f"state machine: {role.value}", "state", "verb", "message", "next state")
    doc = [
        (unquote(r["state"]), r["verb"], unquote(r["message"]), unquote(r["next state"]))
        for r in rows
    ]
    code = [
        (state.value, verb, type_name, nxt.value)
        for (r, state), moves in TRANSITIONS.items() if r is role
        for (verb, type_name), nxt in moves.items()
    ]
    assert len(doc) == len(set(doc)), "a transition is listed twice"
    assert sorted(doc) == sorted(code)


def test_wire_error_code_table_is_error_classes(tables: dict[str, Table]) -> None:
    rows = _rows(tables, "wire error codes", "code", "meaning", "fault")
    codes = [unquote(r["code"]) for r in rows]
    assert len(codes) == len(set(codes))
    assert sorted(codes) == sorted(ERROR_CLASSES)
    assert all(r["meaning"] and r["fault"] for r in rows)


def test_local_only_error_codes_are_the_rest(tables: dict[str, Table]) -> None:
    rows = _rows(tables, "local-only error codes", "code", "meaning", "fault")
    every = {
        obj.code for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, JaildError) and obj is not JaildError
    }
    assert sorted(unquote(r["code"]) for r in rows) == sorted(every - set(ERROR_CLASSES))


def test_status_table_lists_every_status(tables: dict[str, Table]) -> None:
    rows = _rows(tables, "statuses", "status", "when", "`error.type`")
    assert {unquote(r["status"]) for r in rows} == set(STATUSES)


def test_named_limits_have_their_values(text: str) -> None:
    stated = re.findall(r"`(MAX_[A-Z_]+)` \(([\d,]+)\)", text)
    assert stated
    for name, value in stated:
        assert getattr(messages_module, name) == int(value.replace(",", "")), name
