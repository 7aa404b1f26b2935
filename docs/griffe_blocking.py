"""A griffe extension (mkdocs.yml): the blocking facades' methods, as help() shows them.

``Client.run = blocking(AsyncClient.run, renames=BLOCKING)`` (jaild/blocking.py) declares a
blocking method from the asyncio one; read statically, as mkdocstrings reads the source, it
is an attribute with no docstring. This extension makes each such attribute the method it
becomes at run time: the asyncio method's parameters, its docstring with ``renames``
applied, ``returns=`` as its return annotation, and not ``async``.

It acts when the package is loaded (``on_package``), before the per-object events: the
asyncio method's parameters are then as written (``**options: Unpack[RunOptions]``), and
``unpack_typeddict`` expands the declared method's as it expands the asyncio one's.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

from griffe import (
    Attribute,
    Class,
    Docstring,
    Extension,
    Function,
    Module,
    Object,
    Parameters,
)

DECLARERS = {"blocking", "wrapping"}


class BlockingFacades(Extension):
    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            for cls in [m for m in module.members.values()
                        if not m.is_alias and isinstance(m, Class)]:
                for name, member in list(cls.members.items()):
                    if isinstance(member, Attribute) and member.value is not None:
                        declared = self._declared(module, cls, name, member)
                        if declared is not None:
                            cls.set_member(name, declared)

    def _declared(self, module: Module, cls: Class, name: str,
                  member: Attribute) -> Function | None:
        try:
            call = ast.parse(str(member.value), mode="eval").body
        except SyntaxError:
            return None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in DECLARERS and call.args
                and isinstance(call.args[0], ast.Attribute)
                and isinstance(call.args[0].value, ast.Name)):
            return None
        owner, method = call.args[0].value.id, call.args[0].attr
        target = module.members[owner].members[method]
        assert isinstance(target, Function), target.path
        keywords = {k.arg: k.value for k in call.keywords}
        renames: dict[str, str] = {}
        if isinstance(keywords.get("renames"), ast.Name):
            table = module.members[keywords["renames"].id]  # type: ignore[union-attr]
            assert isinstance(table, Attribute)
            renames = ast.literal_eval(str(table.value))
        returns = keywords.get("returns")
        text = target.docstring.value if target.docstring else ""
        for word, blocking_word in renames.items():
            text = text.replace(word, blocking_word)
        func = Function(
            name, lineno=member.lineno, endlineno=member.endlineno,
            parameters=_copied(target.parameters),
            returns=(ast.literal_eval(returns) if isinstance(returns, ast.Constant)
                     else target.returns),
        )
        func.parent = cls
        if text:
            func.docstring = Docstring(text, parent=func, lineno=member.lineno,
                                       parser=target.docstring.parser if target.docstring else None,
                                       parser_options=target.docstring.parser_options
                                       if target.docstring else None)
        return func


def _copied(parameters: Parameters) -> Parameters:
    """The parameters, each copied (their annotations shared: a deep copy would copy the
    whole tree they point into)."""
    return Parameters(*(copy.copy(p) for p in parameters))


def _modules(obj: Object) -> list[Module]:
    out = [obj] if isinstance(obj, Module) else []
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, Module):  # its own, not imported
            out.extend(_modules(member))
    return out
