"""Functions become tools: name, description and a JSON schema from the signature."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

from jaild.toolspec import load_tools_file, normalize_tools, tool_from_function, type_schema


def search(query: str, limit: int = 10, tags: list[str] | None = None, *, exact: bool = False) -> list[str]:
    """Search the catalogue.

    Returns matching titles.
    """
    return []


def test_schema_from_signature() -> None:
    tool = tool_from_function(search)
    assert tool.name == "search"
    assert tool.description == "Search the catalogue.\n\nReturns matching titles."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "default": 10},
            "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None},
            "exact": {"type": "boolean", "default": False},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert not tool.is_async


@dataclass
class Point:
    x: float
    y: float


@pytest.mark.parametrize(
    ("tp", "schema"),
    [
        (Literal["a", "b"], {"enum": ["a", "b"]}),
        (Optional[int], {"anyOf": [{"type": "integer"}, {"type": "null"}]}),  # noqa: UP045
        (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
        (tuple[int, str], {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (Point, {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}),
        (Any, {}),
        (object, {}),
    ],
)
def test_type_schemas(tp: Any, schema: dict[str, Any]) -> None:
    assert type_schema(tp) == schema


def test_kwargs_allow_extra_properties_and_async_is_detected() -> None:
    async def f(**options: Any) -> None: ...

    tool = tool_from_function(f)
    assert "additionalProperties" not in tool.parameters and tool.is_async


def test_normalize_accepts_mappings_lists_and_renames() -> None:
    tools = normalize_tools({"fetch-page": search})
    assert list(tools) == ["fetch-page"]
    assert list(normalize_tools([search])) == ["search"]
    with pytest.raises(ValueError, match="two tools are named"):
        normalize_tools([search, search])
    with pytest.raises(TypeError, match="not callable"):
        normalize_tools({"x": 3})
    with pytest.raises(ValueError, match="must match"):
        normalize_tools({"bad name": search})


def test_tools_file_exposes_public_functions_defined_there(tmp_path: Path) -> None:
    f = tmp_path / "t.py"
    f.write_text("from os.path import join\n\ndef a(x: int) -> int:\n    return x\n\ndef _b():\n    pass\n")
    assert list(load_tools_file(str(f))) == ["a"]
