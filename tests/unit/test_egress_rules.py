"""Egress rules (issue 16): names and ports on the allow-list, addresses never reached."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaild.policy.egress import EgressRules, Rule, RuleError, canonical_name, private_reason

RULES = EgressRules.parse(
    ["api.github.com", "*.githubusercontent.com", "pypi.org:443", "127.0.0.1:9000", "[::1]:8080"]
)


@pytest.mark.parametrize(
    ("host", "port"),
    [
        ("api.github.com", 443),
        ("api.github.com", 80),  # a rule without a port: the policy's ports
        ("API.GitHub.COM.", 443),  # one canonical form: case, trailing dot
        ("raw.githubusercontent.com", 443),
        ("a.b.githubusercontent.com", 443),  # any depth below the wildcard
        ("pypi.org", 443),
        ("127.0.0.1", 9000),
        ("[::1]", 8080),
        ("::1", 8080),
    ],
)
def test_allowed_targets(host: str, port: int) -> None:
    assert RULES.target_refusal(host, port) is None


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("evil.example", 443, "evil.example is not on the allow-list"),
        ("githubusercontent.com", 443, "githubusercontent.com is not on the allow-list"),
        ("api.github.com.evil.example", 443, "is not on the allow-list"),
        ("evilgithubusercontent.com", 443, "is not on the allow-list"),  # not a label boundary
        ("api.github.com", 22, "port 22 of api.github.com is not allowed (its ports: 80, 443)"),
        ("pypi.org", 80, "port 80 of pypi.org is not allowed (its ports: 443)"),
        ("localhost", 9000, "localhost is not on the allow-list"),  # a name is not its address
        ("127.0.0.2", 9000, "127.0.0.2 is not on the allow-list"),
        ("a..b", 443, "is not a valid host name"),
        ("exa mple.com", 443, "is not a valid host name"),
        ("", 443, "an empty host name"),
        ("x" * 300 + ".com", 443, "is not a valid host name"),
    ],
)
def test_refused_targets_say_why(host: str, port: int, why: str) -> None:
    refusal = RULES.target_refusal(host, port)
    assert refusal is not None and why in refusal, refusal


def test_unicode_names_are_their_idna_form() -> None:
    rules = EgressRules.parse(["bücher.example"])
    assert rules.target_refusal("xn--bcher-kva.example", 443) is None
    assert rules.target_refusal("BÜCHER.example", 443) is None
    assert canonical_name("Bücher.Example.") == "xn--bcher-kva.example"


@pytest.mark.parametrize(
    "entry",
    ["*", "*.", "a.*.com", "*x.com", "ex ample.com", "pypi.org:0", "pypi.org:65536",
     "pypi.org:http", "[::1", "[::1]x", ""],
)
def test_bad_rules_are_refused(entry: str) -> None:
    with pytest.raises(RuleError):
        Rule.parse(entry)


def test_describe_lists_the_rules_as_written() -> None:
    assert RULES.describe() == (
        "api.github.com, *.githubusercontent.com, pypi.org:443, 127.0.0.1:9000, [::1]:8080"
    )
    assert EgressRules.parse([]).describe() == "(nothing)"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "the cloud metadata service"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "shared address space"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "private"),  # reserved: Python counts it private
        ("::ffff:10.0.0.1", "carries 10.0.0.1"),  # IPv4-mapped
        ("64:ff9b::7f00:1", "carries 127.0.0.1"),  # NAT64
        ("2002:a9fe:a9fe::1", "carries 169.254.169.254"),  # 6to4
    ],
)
def test_private_addresses_are_refused(address: str, why: str) -> None:
    reason = private_reason(ipaddress.ip_address(address))
    assert reason is not None and why in reason, reason
    assert EgressRules.parse([]).address_refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "140.82.112.3", "2606:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    """Positive control: the same check lets public unicast addresses through."""
    assert private_reason(ipaddress.ip_address(address)) is None


def test_deny_private_off_checks_no_address() -> None:
    rules = EgressRules.parse(["localhost"], deny_private=False)
    assert rules.address_refusal(ipaddress.ip_address("127.0.0.1")) is None


@given(st.ip_addresses())
def test_every_address_the_check_passes_is_global_unicast(address: ipaddress.IPv4Address
                                                          | ipaddress.IPv6Address) -> None:
    if private_reason(address) is None:
        assert address.is_global and not address.is_multicast and not address.is_loopback
        mapped = getattr(address, "ipv4_mapped", None)
        assert mapped is None or mapped.is_global
