"""Field checks for protocol messages.

Every message is a frozen, slotted dataclass whose fields carry a check in their
metadata; ``__post_init__`` runs the checks, so an illegal message cannot be
built. A failing check raises :class:`LocalProtocolError` (we built it); the
receive boundary in :mod:`jaild.protocol.messages` converts that into a
:class:`RemoteProtocolError` when the message came off the wire.

The daemon builds some messages per job from values it has checked already (a record's
parts, a client's job as admitted): :meth:`Struct.trusted` builds those without running the
fields' checks again. It is never used for what arrives from a peer, which always goes
through ``from_wire`` and every check.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar, dataclass_transform

from jaild.errors import LocalProtocolError

Check = Callable[[str, Any], Any]
"""A check takes (field path, value) and returns the (possibly normalised) value or raises."""

MAX_ANY_DEPTH = 32
"""Nesting limit for free-form values (schemas, maps) checked with :func:`any_value`."""

# Limits shared by the messages (:mod:`jaild.protocol.messages`) and the records they carry
# (:mod:`jaild.protocol.records`); both modules export them.
MAX_NAME_CHARS = 128
MAX_MESSAGE_CHARS = 1 << 16
MAX_REF = (1 << 63) - 1
JOB_ID = r"[a-z0-9\-]{1,64}"
SESSION_ID = r"ses-[a-z0-9]{1,60}"
SNAPSHOT_ID = r"snap-[a-f0-9]{32}"
LABEL = r"[a-z0-9][a-z0-9_.:@\-]{0,63}"
"""An information-flow label's name: ``private``, ``user:alice``, ``tenant:acme.eu``."""
MAX_LABELS = 16
"""Labels one tool spec, one result or one policy rule may name."""
TRACEPARENT = r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
"""A W3C Trace Context ``traceparent``, version 00 (the only one): trace id and parent span id
in lowercase hex, neither all zeros, then the trace flags. Exactly 55 characters."""


def _fail(path: str, reason: str) -> LocalProtocolError:
    return LocalProtocolError(f"field {path!r}: {reason}")


def show_number(v: float) -> str:
    """A bound as PROTOCOL.md writes it: ``2^20``, ``2^63-1``, ``86,400``, ``0.001``."""
    if isinstance(v, float) and not v.is_integer():
        return repr(v)
    i = int(v)
    if i >= 1 << 16 and i & (i - 1) == 0:
        return f"2^{i.bit_length() - 1}"
    if i >= (1 << 16) - 1 and (i + 1) & i == 0:
        return f"2^{i.bit_length()}-1"
    return f"{i:,}"


def describe(check: Check, limit: str | None) -> Check:
    """Attach the human form of a check's limit (``check.limit``; None: no limit), which
    PROTOCOL.md's field-limit table states and a test compares."""
    setattr(check, "limit", limit)  # noqa: B010 -- a function attribute, not a typo
    return check


def wire_form(check: Check, form: str) -> Check:
    """Tag a check with the form its values take on the wire when they are not sent as they
    are (:meth:`Struct.to_wire` converts only the fields so tagged): ``struct`` (a nested
    :class:`Struct`), ``list`` (a tuple, sent as a list; its items structs or not)."""
    setattr(check, "wire", form)  # noqa: B010 -- a function attribute, not a typo
    return check


def wire_of(check: Check) -> str | None:
    """The form :func:`wire_form` gave ``check`` (None: its values go as they are)."""
    form: str | None = getattr(check, "wire", None)
    return form


def limit_of(check: Check) -> str | None:
    """The limit a check enforces, as PROTOCOL.md states it (None: none beyond the type)."""
    limit: str | None = getattr(check, "limit", None)
    return limit


def _utf8_ok(v: str) -> bool:
    """False for strings msgpack cannot encode (lone surrogates, e.g. from surrogateescape)."""
    if v.isascii():
        return True
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def string(max_len: int, *, min_len: int = 0, pattern: str | None = None) -> Check:
    rx = re.compile(pattern) if pattern else None

    def check(path: str, v: Any) -> Any:
        if type(v) is not str:  # (the common case skips the typed word's look-up)
            v = _plain(v)
            if type(v) is not str:
                raise _fail(path, f"expected a string, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise _fail(path, f"length {len(v)} outside {min_len}..{max_len}")
        if rx is not None and rx.fullmatch(v) is None:
            raise _fail(path, f"{v[:64]!r} does not match {pattern}")
        if not _utf8_ok(v):
            raise _fail(path, "not encodable as UTF-8 (lone surrogate)")
        return v

    size = f"{min_len}..{show_number(max_len)}" if min_len else f"at most {show_number(max_len)}"
    return describe(check, f"{size} chars" + (f" matching `{pattern}`" if pattern else ""))


def integer(lo: int, hi: int) -> Check:
    def check(path: str, v: Any) -> Any:
        if type(v) is not int:
            raise _fail(path, f"expected an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _fail(path, f"{v} outside {lo}..{hi}")
        return v

    return describe(check, f"{show_number(lo)} .. {show_number(hi)}")


def number(lo: float, hi: float) -> Check:
    def check(path: str, v: Any) -> Any:
        if type(v) not in (int, float):
            raise _fail(path, f"expected a number, got {type(v).__name__}")
        if not lo <= v <= hi:  # also rejects NaN
            raise _fail(path, f"{v} outside {lo}..{hi}")
        return v

    return describe(check, f"{show_number(lo)} .. {show_number(hi)}")


def boolean() -> Check:
    def check(path: str, v: Any) -> Any:
        if type(v) is not bool:
            raise _fail(path, f"expected a boolean, got {type(v).__name__}")
        return v

    return describe(check, None)


def binary(max_len: int) -> Check:
    def check(path: str, v: Any) -> Any:
        if type(v) is not bytes:
            raise _fail(path, f"expected bytes, got {type(v).__name__}")
        if len(v) > max_len:
            raise _fail(path, f"{len(v)} bytes exceeds {max_len}")
        return v

    return describe(check, f"at most {show_number(max_len)} bytes")


def _plain(v: Any) -> Any:
    """A member of a :class:`enum.StrEnum` (a typed word of the daemon's, such as a flow
    code) as the plain string it stands for: a struct holds what the wire carries. Nothing
    off the wire is one (msgpack makes plain ``str``)."""
    return v.value if isinstance(v, enum.StrEnum) else v


def one_of(*values: str) -> Check:
    allowed = frozenset(values)

    def check(path: str, v: Any) -> Any:
        if type(v) is not str:
            v = _plain(v)
        if type(v) is not str or v not in allowed:
            raise _fail(path, f"expected one of {sorted(allowed)}, got {v!r}")
        return v

    return describe(check, "one of " + ", ".join(f"`{v}`" for v in values))


E = TypeVar("E", bound=enum.StrEnum)


def member_of(kind: type[E]) -> Check:
    """One of the words of ``kind`` (a :class:`enum.StrEnum`), held as its member: the wire
    carries the word, the field reads as the typed member. Checked as :func:`one_of` is,
    with its message."""
    words = one_of(*(member.value for member in kind))

    def check(path: str, v: Any) -> Any:
        return kind(words(path, v))

    return describe(check, limit_of(words))


def optional(inner: Check) -> Check:
    def check(path: str, v: Any) -> Any:
        return None if v is None else inner(path, v)

    form = wire_of(inner)
    if form is not None:
        wire_form(check, form)
    return describe(check, limit_of(inner))


def list_of(inner: Check, max_items: int) -> Check:
    """A list or tuple of items; normalised to a tuple."""

    def check(path: str, v: Any) -> Any:
        if type(v) not in (list, tuple):
            raise _fail(path, f"expected a list, got {type(v).__name__}")
        if len(v) > max_items:
            raise _fail(path, f"{len(v)} items exceeds {max_items}")
        return tuple(inner(f"{path}[{i}]", item) for i, item in enumerate(v))

    each = limit_of(inner)
    wire_form(check, "list")
    return describe(
        check, f"at most {show_number(max_items)} items" + (f"; each {each}" if each else "")
    )


def map_of(key: Check, value: Check, max_items: int) -> Check:
    def check(path: str, v: Any) -> Any:
        if type(v) is not dict:
            raise _fail(path, f"expected a map, got {type(v).__name__}")
        if len(v) > max_items:
            raise _fail(path, f"{len(v)} entries exceeds {max_items}")
        return {key(f"{path}.<key>", k): value(f"{path}.{k}", item) for k, item in v.items()}

    keys, values = limit_of(key), limit_of(value)
    if wire_of(value) == "struct":
        wire_form(check, "map")
    return describe(
        check,
        f"at most {show_number(max_items)} entries"
        + (f"; keys {keys}" if keys else "")
        + (f"; values {values}" if values else ""),
    )


_SCALARS = (type(None), bool, int, float, str, bytes)


def any_value(max_depth: int = MAX_ANY_DEPTH) -> Check:
    """Any plain msgpack value (nil, bool, int, float, str, bytes, list, map) up to a depth.

    Iterative, so hostile nesting cannot exhaust the Python stack.
    """

    def check(path: str, v: Any) -> Any:
        stack: list[tuple[Any, int]] = [(v, 0)]
        while stack:
            item, depth = stack.pop()
            t = type(item)
            if t is str and not _utf8_ok(item):
                raise _fail(path, "a string is not encodable as UTF-8 (lone surrogate)")
            if t in _SCALARS:
                continue
            if depth >= max_depth:
                raise _fail(path, f"nested deeper than {max_depth}")
            if t is list or t is tuple:
                stack.extend((x, depth + 1) for x in item)
            elif t is dict:
                for k, x in item.items():
                    if type(k) not in (str, int):
                        raise _fail(path, f"map key of type {type(k).__name__}")
                    if type(k) is str and not _utf8_ok(k):
                        raise _fail(path, "a map key is not encodable as UTF-8 (lone surrogate)")
                    stack.append((x, depth + 1))
            else:
                raise _fail(path, f"{t.__name__} is not a plain msgpack value")
        return v

    return describe(check, f"nested at most {max_depth} levels")


def any_map(max_depth: int = MAX_ANY_DEPTH) -> Check:
    """Like :func:`any_value`, but the value itself must be a map."""
    inner = any_value(max_depth)

    def check(path: str, v: Any) -> Any:
        if type(v) is not dict:
            raise _fail(path, f"expected a map, got {type(v).__name__}")
        return inner(path, v)

    return describe(check, limit_of(inner))


S = TypeVar("S", bound="Struct")


def field(check: Check, **kwargs: Any) -> Any:
    """A dataclass field carrying its check."""
    return dataclasses.field(metadata={"check": check}, **kwargs)


class Struct:
    """Base of messages and of structures nested in them."""

    __slots__ = ()
    _checks: ClassVar[tuple[tuple[str, Check], ...]] = ()
    _required: ClassVar[frozenset[str]] = frozenset()
    _names: ClassVar[frozenset[str]] = frozenset()
    _order: ClassVar[tuple[str, ...]] = ()  # the field names, in order
    # (instance) -> every field's value, in order; an attrgetter (not a descriptor) or a
    # staticmethod, so ``self._values(self)`` calls it with the instance
    _values: ClassVar[Any] = staticmethod(lambda _: ())
    _converted: ClassVar[tuple[tuple[str, str], ...]] = ()  # (name, wire form) to convert

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)

    @classmethod
    def _prepare(cls) -> None:
        """Build the per-class check table once the dataclass decorator has run."""
        fs = dataclasses.fields(cls)  # type: ignore[arg-type]
        cls._checks = tuple((f.name, f.metadata["check"]) for f in fs)
        cls._names = frozenset(f.name for f in fs)
        cls._order = tuple(f.name for f in fs)
        # every field's value in one C call (attrgetter of one name returns it bare)
        if len(cls._order) > 1:
            cls._values = operator.attrgetter(*cls._order)
        elif cls._order:
            one = operator.attrgetter(cls._order[0])
            cls._values = staticmethod(lambda o: (one(o),))
        cls._converted = tuple(
            (f.name, form)
            for f in fs
            if (form := wire_of(f.metadata["check"])) is not None
        )
        cls._required = frozenset(
            f.name
            for f in fs
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    def __post_init__(self) -> None:
        for (name, check), value in zip(self._checks, self._values(self), strict=True):
            checked = check(name, value)
            if checked is not value:
                object.__setattr__(self, name, checked)
        self._invariant()

    def _invariant(self) -> None:
        """What must hold between fields (a subclass's; raise :class:`LocalProtocolError`).
        Run after the fields' checks, and by :meth:`trusted` construction too."""

    @classmethod
    def trusted(cls: type[S], *args: Any, **kwargs: Any) -> S:
        """A struct the daemon builds from values it has already checked, or made itself in
        the form its fields hold: the same arguments as the class, the fields' checks not
        run again (:meth:`_invariant` still is). Never for what came from a peer: that goes
        through the class itself (``from_wire``), every check run. Values must already be
        in their checked form (tuples, not lists; nested structs, not maps; plain strings,
        not typed words), as :meth:`to_wire` sends them as they are.

        Replaced per class by :func:`struct` with a generated constructor."""
        return cls(*args, **kwargs)

    def to_wire(self) -> dict[str, Any]:
        """The wire form: a map of every field; nested structs as maps, tuples as lists."""
        out = dict(zip(self._order, self._values(self), strict=True))
        for name, form in self._converted:
            value = out[name]
            if value is None:
                continue
            if form == "struct":
                out[name] = value.to_wire()
            elif form == "list":
                out[name] = [v.to_wire() if isinstance(v, Struct) else v for v in value]
            else:  # a map of structs
                out[name] = {k: v.to_wire() for k, v in value.items()}
        return out

    @classmethod
    def from_wire(cls: type[S], data: Mapping[str, Any]) -> S:
        keys = set(data)
        unknown = keys - cls._names
        if unknown:
            names = sorted(map(str, unknown))
            raise LocalProtocolError(f"{cls.__name__}: unknown field(s) {names}")
        missing = cls._required - keys
        if missing:
            raise LocalProtocolError(f"{cls.__name__}: missing field(s) {sorted(missing)}")
        return cls(**data)


def nested(cls: type[S]) -> Check:
    """A nested structure, given as a map on the wire."""

    def check(path: str, v: Any) -> Any:
        if isinstance(v, cls):
            return v
        if type(v) is not dict:
            raise _fail(path, f"expected a {cls.__name__} map, got {type(v).__name__}")
        try:
            return cls.from_wire(v)
        except LocalProtocolError as exc:
            raise _fail(path, str(exc)) from None
        except TypeError as exc:
            raise _fail(path, str(exc)) from None

    wire_form(check, "struct")
    return describe(check, None)


_NO_VALUE: Any = object()
"""A trusted constructor's default for a field with a default factory: call the factory."""


def _trusted_constructor(cls: type[S]) -> Callable[..., S]:
    """``cls``'s :meth:`Struct.trusted`: the dataclass ``__init__``'s signature (the same
    names, order and defaults), setting each slot without its check. Generated, as
    :mod:`dataclasses` generates ``__init__``: one plain function, no loop over fields."""
    if cls.__post_init__ is not Struct.__post_init__:  # checks of its own: keep them all
        return cls
    names: dict[str, Any] = {"_new": object.__new__, "_set": object.__setattr__, "_cls": cls,
                             "_NO_VALUE": _NO_VALUE}
    params, body = [], ["    _self = _new(_cls)"]
    for i, f in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            names[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_NO_VALUE")
            body.append(f"    if {f.name} is _NO_VALUE:\n        {f.name} = _factory{i}()")
        else:
            params.append(f.name)
        body.append(f"    _set(_self, {f.name!r}, {f.name})")
    if cls._invariant is not Struct._invariant:
        body.append("    _self._invariant()")
    body.append("    return _self")
    source = f"def trusted({', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(source, names)  # our own field names, as dataclasses generates __init__
    made: Callable[..., S] = names["trusted"]
    made.__qualname__ = f"{cls.__qualname__}.trusted"
    made.__doc__ = Struct.trusted.__doc__
    return made


@dataclass_transform(frozen_default=True, field_specifiers=(field, dataclasses.field))
def struct(cls: type[S]) -> type[S]:
    """Class decorator: frozen slotted dataclass with checks prepared, and its trusted
    constructor (:meth:`Struct.trusted`)."""
    dc = dataclasses.dataclass(frozen=True, slots=True)(cls)
    dc._prepare()
    dc.trusted = staticmethod(_trusted_constructor(dc))  # type: ignore[method-assign]
    return dc
