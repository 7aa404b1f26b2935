"""Egress rules: which names and ports a policy's jails may reach, and which addresses never.

Theory of operation
-------------------
A policy in ``network.mode = "egress"`` lists the destinations its jails may reach by
name (``[egress] allow``). Each entry is a *rule*:

=============================  =================================================
``api.github.com``             that name, on any of the policy's ports
``*.githubusercontent.com``    any name below it (not the name itself)
``pypi.org:443``               that name, on that port only
``192.0.2.7:8080``             an address literal: only a target written as that
                               literal, never a name that resolves to it
=============================  =================================================

Names are compared in one canonical form -- lowercase, no trailing dot, IDNA (so a
Unicode name and its ``xn--`` form are one name) -- and a target that is not a valid
host name or address literal is refused before any rule is read. A rule without a port
allows the policy's ``ports`` (80 and 443 unless the policy says otherwise).

Names are resolved on the host, by the gateway, never in the jail. With
``deny_private`` every address a name resolves to is checked *after* resolution and
*before* each connection attempt (the gateway connects to the address it checked, not to
the name again, so a name that changes between check and connect -- DNS rebinding --
cannot slip through): anything that is not a public unicast address is refused --
loopback, RFC 1918, link-local (the cloud metadata address 169.254.169.254 among them),
shared address space (100.64/10), unique local (fc00::/7), multicast, reserved and
unspecified addresses, and IPv6 forms that carry such an IPv4 address (IPv4-mapped,
NAT64 ``64:ff9b::/96``, 6to4, Teredo).

This module is pure: it parses rules, canonicalises targets and classifies addresses.
The gateway (``jaild.daemon.egress.gateway``) does the IO and asks it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from jaild.errors import EgressRuleError as RuleError

DEFAULT_PORTS = (80, 443)
MAX_NAME_CHARS = 253
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def canonical_name(name: str) -> str:
    """``name`` lowercased, IDNA-encoded, without a trailing dot -- or RuleError."""
    text = name.strip()
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise RuleError("an empty host name")
    try:
        ascii_name = text.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise RuleError(f"{name!r} is not a valid host name ({exc})") from None
    if len(ascii_name) > MAX_NAME_CHARS:
        raise RuleError(f"{name!r} is longer than {MAX_NAME_CHARS} characters")
    for label in ascii_name.split("."):
        if not _LABEL.match(label):
            raise RuleError(f"{name!r} is not a valid host name (label {label!r})")
    return ascii_name


def parse_host(host: str) -> str | Address:
    """A target's host: an address (``[::1]`` and ``::1`` both allowed) or a canonical name."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return canonical_name(text)


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host[:port]`` (an IPv6 literal needs brackets to take a port)."""
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket:
            raise RuleError(f"{entry!r}: an unclosed '['")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise RuleError(f"{entry!r}: expected ':port' after ']'")
        return host, _port(entry, rest[1:])
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None  # a name, or an IPv6 literal without a port


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise RuleError(f"{entry!r}: the port must be a number from 1 to 65535")
    return int(text)


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``allow`` entry, parsed (see the module docstring)."""

    text: str  # as the policy wrote it, for messages
    host: str | Address  # a canonical name, the suffix of a wildcard, or an address
    wildcard: bool
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> Rule:
        text = entry.strip()
        host, port = _split_port(text)
        wildcard = host.startswith("*.")
        if wildcard:
            return cls(text, canonical_name(host[2:]), True, port)
        if "*" in host:
            raise RuleError(f"{entry!r}: a wildcard may only be a whole first label ('*.')")
        return cls(text, parse_host(host), False, port)

    def names(self, host: str | Address) -> bool:
        """The rule covers this host (on some port)."""
        if self.wildcard:
            return isinstance(host, str) and host.endswith("." + str(self.host))
        return host == self.host

    def allows_port(self, port: int, ports: tuple[int, ...]) -> bool:
        return port == self.port if self.port is not None else port in ports


@dataclass(frozen=True)
class EgressRules:
    """A policy's egress rules: its allow-list, its ports, and ``deny_private``."""

    allow: tuple[Rule, ...]
    ports: tuple[int, ...] = DEFAULT_PORTS
    deny_private: bool = True

    @classmethod
    def parse(
        cls, allow: Iterable[str], ports: Iterable[int] = DEFAULT_PORTS, deny_private: bool = True
    ) -> EgressRules:
        return cls(tuple(Rule.parse(a) for a in allow), tuple(ports), deny_private)

    def describe(self) -> str:
        """The allow-list as a model should read it: ``api.github.com, pypi.org:443``."""
        return ", ".join(r.text for r in self.allow) or "(nothing)"

    def target_refusal(self, host: str, port: int) -> str | None:
        """Why ``host:port`` may not be reached (before any resolution), or None."""
        try:
            parsed = parse_host(host)
        except RuleError as exc:
            return str(exc)
        covering = [r for r in self.allow if r.names(parsed)]
        if any(r.allows_port(port, self.ports) for r in covering):
            return None
        shown = f"[{parsed}]" if isinstance(parsed, ipaddress.IPv6Address) else str(parsed)
        if not covering:
            return f"{shown} is not on the allow-list"
        named = {r.port for r in covering if r.port is not None}
        if any(r.port is None for r in covering):
            named |= set(self.ports)
        listed = ", ".join(map(str, sorted(named)))
        return f"port {port} of {shown} is not allowed (its ports: {listed})"

    def address_refusal(self, address: Address) -> str | None:
        """Why a resolved (or literal) address may not be connected to, or None."""
        if not self.deny_private:
            return None
        return private_reason(address)


def private_reason(address: Address) -> str | None:
    """Why ``address`` is not a public unicast address (see the module docstring), or None."""
    for inner in _embedded_ipv4(address):
        why = private_reason(inner)
        if why is not None:
            return f"{address} carries {inner}: {why}"
    if address.is_loopback:
        return f"{address} is a loopback address"
    if address.is_link_local:
        metadata = " (the cloud metadata service)" if str(address) == _METADATA else ""
        return f"{address} is a link-local address{metadata}"
    if address.is_multicast:
        return f"{address} is a multicast address"
    if address.is_unspecified:
        return f"{address} is the unspecified address"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return f"{address} is in the shared address space (100.64.0.0/10)"
    if address.is_private:
        return f"{address} is a private address"
    if address.is_reserved or not address.is_global:
        return f"{address} is not a public address"
    return None


_SHARED = ipaddress.IPv4Network("100.64.0.0/10")
_METADATA = "169.254.169.254"


def _embedded_ipv4(address: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address stands for (mapped, NAT64, 6to4, Teredo)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    out = []
    if address.ipv4_mapped is not None:
        out.append(address.ipv4_mapped)
    if address in _NAT64:
        out.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    if address.sixtofour is not None:
        out.append(address.sixtofour)
    if address.teredo is not None:
        out.extend(address.teredo)
    return out


__all__ = [
    "DEFAULT_PORTS",
    "EgressRules",
    "Rule",
    "RuleError",
    "canonical_name",
    "parse_host",
    "private_reason",
]
