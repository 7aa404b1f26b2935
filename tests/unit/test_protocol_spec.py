"""proto/PROTOCOL.md agrees with the code, in full: messages, fields, structures, records,
field limits, frame sizes, states, error codes, statuses, named constants and the version.

The spec's tables are plain GitHub Markdown under ``### <name>`` headings; a ``|`` inside a
cell is written ``\\|``. A fields cell lists each field in backticks as ``name: type`` or
``name?: type = default`` (``?``: may be omitted; the default is a Python literal).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import itertools
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from jaild import errors
from jaild.errors import ERROR_CLASSES, JaildError
from jaild.protocol import MESSAGES, PROTOCOL_VERSION, Role
from jaild.protocol import fields as fields_module
from jaild.protocol import messages as messages_module
from jaild.protocol import records as records_module
from jaild.protocol.connection import TRANSITIONS
from jaild.protocol.fields import Struct, limit_of
from jaild.protocol.messages import Message
from jaild.protocol.records import RECORDS, STATUSES

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
    """The fields as the wire has them: a field typed by a :class:`enum.StrEnum` (a typed
    word, such as ``SnapshotEntry.kind``) is a ``str`` there, its default the word."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        optional = f.name not in cls._required
        if not optional:
            default: Any = _NO_DEFAULT
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        kind = hints[f.name]
        if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
            out.append(DocField(f.name, optional, "str",
                                default.value if isinstance(default, enum.StrEnum) else default))
            continue
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
        and not issubclass(obj, Message) and obj.__module__ == messages_module.__name__
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
        module = next(m for m in (messages_module, records_module, fields_module)
                      if hasattr(m, name))
        assert getattr(module, name) == int(value.replace(",", "")), name


def test_named_constant_table_is_every_constant_of_the_protocol(tables: dict[str, Table]) -> None:
    rows = _rows(tables, "named constants", "constant", "value", "module")
    modules = {"fields": fields_module, "messages": messages_module, "records": records_module}
    doc = {unquote(r["constant"]): (r["value"], unquote(r["module"])) for r in rows}
    assert len(doc) == len(rows), "a constant is listed twice"
    for name, (value, module) in doc.items():
        assert vars(modules[module]).get(name) == int(value.replace(",", "")), name
    defined = {
        name for m in modules.values() for name, v in vars(m).items()
        if (name.startswith("MAX_") or name == "FRAME_OVERHEAD") and type(v) in (int, float)
        and _defined_in(m, name)
    }
    assert set(doc) == defined


def _defined_in(module: Any, name: str) -> bool:
    """``name`` is assigned in ``module``'s own source (not imported into it)."""
    return re.search(rf"^{name}\b.*=", inspect.getsource(module), re.MULTILINE) is not None


def test_every_stated_protocol_number_is_this_version(text: str) -> None:
    stated = re.findall(r"protocol: (\d+)", text)
    assert stated  # the handshake examples
    assert {int(v) for v in stated} == {PROTOCOL_VERSION}


# --------------------------------------------------------------------------- records (section 10)


def test_record_tables_list_every_record_and_field(tables: dict[str, Table]) -> None:
    documented = {h.removeprefix("record: ") for h in tables if h.startswith("record: ")}
    assert documented == {cls.__name__ for cls in RECORDS}
    for cls in RECORDS:
        where = f"record: {cls.__name__}"
        rows = _rows(tables, where, "field", "meaning")
        doc = [f for row in rows for f in parse_fields(row["field"])]
        assert len(doc) == len(rows), f"{where}: one field per row"
        code = code_fields(cls)
        assert [f.name for f in doc] == [f.name for f in code], f"{where}: field names"
        for d, c in zip(doc, code, strict=True):
            assert d == c, f"{where}.{d.name}: spec {d}, code {c}"
        assert all(row["meaning"] for row in rows), f"{where}: a field without meaning"


def test_record_tables_say_what_the_users_view_leaves_out(tables: dict[str, Table]) -> None:
    """A record's ``to_dict`` omits its SPARSE fields when nil (SPARSE_EMPTY: when empty);
    the meaning cell of exactly those fields says "(omitted when nil)" / "(omitted when
    empty)"."""
    for cls in RECORDS:
        for row in tables[f"record: {cls.__name__}"]:
            (f,) = parse_fields(row["field"])
            nil = "(omitted when nil)" in row["meaning"]
            empty = "(omitted when empty)" in row["meaning"]
            assert nil == (f.name in cls.SPARSE), f"{cls.__name__}.{f.name}: omitted when nil?"
            assert empty == (f.name in cls.SPARSE_EMPTY), f"{cls.__name__}.{f.name}: when empty?"


# --------------------------------------------------------------------------- field limits


def code_limits() -> dict[tuple[str, str], str]:
    """(owner, field) -> the limit its check enforces, for every field that has one. The
    owner is a message's wire name (both links' ``CallTool`` are one owner: their limits
    must agree) or a structure's or record's class name."""
    owners: list[tuple[str, type[Struct]]] = [
        (cls.TYPE, cls) for table in MESSAGES.values() for cls in table.values()
    ]
    structures = [
        obj for obj in vars(messages_module).values()
        if isinstance(obj, type) and issubclass(obj, Struct)
        and not issubclass(obj, Message) and obj.__module__ == messages_module.__name__
    ]
    owners += [(cls.__name__, cls) for cls in (*structures, *RECORDS)]
    out: dict[tuple[str, str], str] = {}
    for owner, cls in owners:
        for name, check in cls._checks:
            limit = limit_of(check)
            if limit is None:
                continue
            key = (owner, name)
            assert out.setdefault(key, limit) == limit, f"{owner}.{name}: two limits"
            out[key] = limit
    return out


def render_field_limits() -> str:
    """The field-limit table as it could be written: a bare name where every field of that
    name has the same limit, ``Owner.name`` otherwise (what to paste into PROTOCOL.md)."""
    limits = code_limits()
    by_name: dict[str, set[str]] = {}
    for (_, name), limit in limits.items():
        by_name.setdefault(name, set()).add(limit)
    rows: dict[str, list[str]] = {}
    for (owner, name), limit in sorted(limits.items()):
        label = name if len(by_name[name]) == 1 else f"{owner}.{name}"
        if f"`{label}`" not in rows.setdefault(limit, []):
            rows[limit].append(f"`{label}`")
    lines = ["| field | limit |", "|---|---|"]
    lines += [f"| {', '.join(labels)} | {limit} |"
              for limit, labels in sorted(rows.items(), key=lambda kv: kv[1][0])]
    return "\n".join(lines).replace("|`", "| `")


def test_field_limit_table_states_every_limit_of_the_code(tables: dict[str, Table]) -> None:
    """Every bounded field of every message, structure and record is named exactly once --
    as ``Owner.field``, or by a bare ``field`` that covers every field of that name no
    qualified entry names -- with the limit its check enforces."""
    rows = _rows(tables, "field limits", "field", "limit")
    code = code_limits()
    covered: dict[tuple[str, str], str] = {}
    bare: dict[str, str] = {}
    for row in rows:
        for label in re.findall(r"`([^`]+)`", row["field"]):
            if "." in label:
                key = tuple(label.split(".", 1))
                assert key in code, f"{label}: no such bounded field"
                assert key not in covered, f"{label}: listed twice"
                covered[key] = row["limit"]  # type: ignore[index]
            else:
                assert label not in bare, f"{label}: listed twice"
                bare[label] = row["limit"]
    for key in code:
        if key not in covered and key[1] in bare:
            covered[key] = bare[key[1]]
    assert all(any(k[1] == name for k in code) for name in bare), "a bare name names nothing"
    missing = sorted(".".join(k) for k in code if k not in covered)
    assert not missing, f"fields whose limit PROTOCOL.md does not state: {missing}"
    wrong = {".".join(k): (covered[k], code[k]) for k in code if covered[k] != code[k]}
    assert not wrong, f"spec vs code: {wrong}\n\n{render_field_limits()}"


# --------------------------------------------------------------------------- frame sizes

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def _resolve(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:  # a class attribute: module.Class.attr
        owner = _resolve(module_name)
        fields_by_name = {f.name: f for f in dataclasses.fields(owner)}
        return fields_by_name[attr].default
    return getattr(module, attr)


def test_frame_size_table_is_the_code(tables: dict[str, Table]) -> None:
    """Each row's size is a Python expression (constants of messages.py, ``KiB``/``MiB``,
    and the arguments of the function the ``code`` column names); it must equal that
    constant, or that function for every combination of sample arguments."""
    rows = _rows(tables, "frame sizes", "receiver", "maximum frame size", "code")
    names = {**vars(messages_module), **_UNITS}
    seen = set()
    for row in rows:
        expr, target = unquote(row["maximum frame size"]), unquote(row["code"])
        seen.add(target)
        value = _resolve(target)
        if not callable(value):
            assert eval(expr, {}, names) == value, f"{row['receiver']}: {expr} != {target}"
            continue
        params = list(inspect.signature(value).parameters)
        samples = (0, 64, 1 << 20)
        for combo in itertools.product(samples, repeat=len(params)):
            kwargs = dict(zip(params, combo, strict=True))
            assert eval(expr, {"max": max}, {**names, **kwargs}) == value(**kwargs), (
                f"{row['receiver']}: {expr} vs {target}({kwargs})"
            )
    assert seen == {"jaild.daemon.config.DaemonConfig.max_frame_bytes", "jaild.client.MAX_FRAME",
                    "jaild.protocol.messages.jail_link_max_frame",
                    "jaild.runtime.main.JAIL_MAX_FRAME"}
