"""The optional parts of jaild, and the extra that installs each.

``pip install jaild`` is the client library and the daemon. Each front end beyond them comes
with an extra (pyproject.toml): without it, the front end says which in one line, with the pip
command, and never with a traceback::

    $ jaild mcp
    jaild mcp needs jaild[mcp]: pip install 'jaild[mcp]'

Checked before the optional package is imported, so what is missing is named even when the
package is there but broken in a way ``import`` would report at length.
"""

from __future__ import annotations

import importlib.util

from jaild.errors import MissingExtra

EXTRAS: dict[str, tuple[str, ...]] = {
    "mcp": ("mcp",),
    "codemode": ("openai",),
    "langchain": ("langchain_core",),
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
    "uvloop": ("uvloop",),
}
"""Each extra of pyproject.toml that a part of jaild needs at run time -> the modules it
brings (tests/unit/test_extras.py keeps this equal to pyproject.toml's extras)."""


def installed(extra: str) -> bool:
    """Whether every module ``extra`` brings can be found (none is imported)."""
    for module in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            return False
    return True


def require(extra: str, what: str) -> None:
    """Raise :class:`~jaild.errors.MissingExtra` unless ``extra`` is installed.

    Args:
        extra: a key of :data:`EXTRAS`.
        what: the part that needs it, as the user named it (``jaild mcp``, ``CodeMode``).
    Raises:
        MissingExtra: ``"<what> needs jaild[<extra>]: pip install 'jaild[<extra>]'"``.
    """
    if not installed(extra):
        raise MissingExtra(what, extra)


__all__ = ["EXTRAS", "installed", "require"]
