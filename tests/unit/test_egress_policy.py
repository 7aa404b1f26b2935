"""``network.mode = "egress"`` in policies, plans and the daemon's start: validation with
file, key and reason; the jail's environment and mounts; secrets that stay on the host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaild.daemon.egress.service import EgressService, read_secrets
from jaild.errors import PolicyError, StartupError
from jaild.policy.compile import (
    EGRESS_ENVIRONMENT,
    JAIL_ENV,
    JAIL_TRUST,
    CgroupLayout,
    HostLayout,
    compile_policy,
    compile_zygote,
)
from jaild.policy.schema import load_policy_text, reference_markdown

EGRESS = """
[network]
mode = "egress"
[egress]
allow = ["api.github.com", "*.githubusercontent.com", "pypi.org:443"]
"""


def error_of(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "/p/web.toml")
    return info.value.message


def test_an_egress_policy_loads_with_its_defaults() -> None:
    policy = load_policy_text(EGRESS, "/p/web.toml")
    e = policy.egress
    assert e.allow == ("api.github.com", "*.githubusercontent.com", "pypi.org:443")
    assert (e.ports, e.deny_private, e.max_requests, e.max_bytes) == ((80, 443), True, 200,
                                                                      100 << 20)
    assert policy.summary()["egress"] == list(e.allow)
    assert load_policy_text("", "/p/plain.toml").summary()["egress"] == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[egress]\nallow = ["a.com"]',
         '/p/web.toml: egress: needs network.mode = "egress"'),
        ('[network]\nmode = "egress"',
         '/p/web.toml: egress.allow: is empty: network.mode = "egress" would reach nothing'),
        (EGRESS.replace('"pypi.org:443"', '"pypi.org:99999"'),
         "/p/web.toml: egress.allow: entry 2: 'pypi.org:99999': the port must be a number"),
        (EGRESS.replace('"api.github.com"', '"api.*.com"'),
         "/p/web.toml: egress.allow: entry 0: 'api.*.com': a wildcard may only be"),
        (EGRESS + "ports = [0]", "/p/web.toml: egress.ports: ports must be from 1 to 65535"),
        (EGRESS + 'ports = ["80"]', "/p/web.toml: egress.ports[0]: must be an integer"),
        (EGRESS + "max_requests = -1", "/p/web.toml: egress.max_requests: must be between"),
        (EGRESS + "colour = 1", "/p/web.toml: egress.colour: unknown key; [egress] accepts"),
        (EGRESS + '[[egress.inject]]\nhost = "example.com"\nheader = "A"\nvalue_env = "T"',
         "/p/web.toml: egress.inject[0].host: example.com is not on egress.allow"),
        (EGRESS + '[[egress.inject]]\nhost = "api.github.com"\nheader = "Host"\nvalue_env = "T"',
         "/p/web.toml: egress.inject[0].header: Host frames or routes a request"),
        (EGRESS + '[[egress.inject]]\nhost = "api.github.com"\nheader = "A B"\nvalue_env = "T"',
         "/p/web.toml: egress.inject[0].header: 'A B' is not an HTTP header name"),
        (EGRESS + '[[egress.inject]]\nhost = "api.github.com"\nheader = "A"\nvalue_env = "1"',
         "/p/web.toml: egress.inject[0].value_env: '1' is not a variable name"),
        (EGRESS + '[[egress.inject]]\nhost = "api.github.com"\nheader = "A"',
         "/p/web.toml: egress.inject[0].value_env: must be a string, got None"),
        (EGRESS + '[[egress.inject]]\nhost = "api.github.com"\nheader = "A"\nvalue_env = "T"\n'
         'value = "x"', "/p/web.toml: egress.inject[0].value: unknown key"),
        (EGRESS + '[[egress.inject]]\nhost = "API.github.com."\nheader = "A"\nvalue_env = "T"\n'
         '[[egress.inject]]\nhost = "api.github.com"\nheader = "a"\nvalue_env = "U"',
         "/p/web.toml: egress.inject[1].header: a is injected for api.github.com twice"),
    ],
)
def test_mistakes_name_file_key_and_reason(text: str, message: str) -> None:
    assert error_of(text).startswith(message), error_of(text)


def test_the_reference_documents_egress() -> None:
    ref = reference_markdown()
    assert '| `network.mode` | string | `"none"` |' in ref and '"egress"' in ref
    for key in ("egress.allow", "egress.ports", "egress.deny_private", "egress.max_requests",
                "egress.max_bytes", "[[egress.inject]]"):
        assert f"| `{key}` |" in ref, key


HOST = HostLayout("/rt", "/envs", CgroupLayout(2, "jaild"), egress_trust="/state/egress/trust.pem",
                  certifi=(("/envs/default",
                            "/envs/default/lib/python3.11/site-packages/certifi/cacert.pem"),))


def test_an_egress_jail_has_loopback_the_proxy_and_the_trust_bundle() -> None:
    policy = load_policy_text(EGRESS, "/p/web.toml")
    for plan in (compile_policy(policy, HOST), compile_zygote(policy, HOST)):
        assert plan.jail.loopback and "net" in plan.jail.namespaces
        assert set(EGRESS_ENVIRONMENT) <= set(plan.env)
        assert "HTTPS_PROXY=http://127.0.0.1:3128" in plan.env
        binds = {m.target: m.source for m in plan.mounts if m.kind == "bind"}
        assert binds[JAIL_TRUST] == "/state/egress/trust.pem"
        certifi = f"{JAIL_ENV}/lib/python3.11/site-packages/certifi/cacert.pem"
        assert binds[certifi] == "/state/egress/trust.pem"
    plain = compile_policy(load_policy_text("", "/p/plain.toml"), HOST)
    assert not plain.jail.loopback
    assert not any("PROXY" in v for v in plain.env)
    assert JAIL_TRUST not in {m.target for m in plain.mounts}


def secrets_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "secrets"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_secrets_come_from_a_private_file(tmp_path: Path) -> None:
    path = secrets_file(tmp_path, "# c\n\nA=1\n B = two words \n")
    assert read_secrets(path) == {"A": "1", "B": "two words"}
    for mode in (0o640, 0o604):
        os.chmod(path, mode)
        with pytest.raises(StartupError, match=r"must be 0600 \(or stricter\)"):
            read_secrets(path)
    with pytest.raises(StartupError, match=r":1: daemon.egress_secrets: expected NAME=value"):
        read_secrets(secrets_file(tmp_path, "oops\n"))
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(StartupError, match="cannot open"):
        read_secrets(str(link))


INJECT = EGRESS + """
[[egress.inject]]
host = "api.github.com"
header = "Authorization"
value_env = "JAILD_UNIT_TOKEN"
"""


def test_the_service_reads_injected_values_or_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = load_policy_text(INJECT, "/p/web.toml")
    monkeypatch.delenv("JAILD_UNIT_TOKEN", raising=False)
    with pytest.raises(StartupError, match=r"/p/web.toml: egress.inject\[0\].value_env: "
                                           r"JAILD_UNIT_TOKEN is not set in"):
        EgressService.prepare({"web": policy}, str(tmp_path), lambda *_: None)
    path = secrets_file(tmp_path, "JAILD_UNIT_TOKEN=from-file\n")
    service = EgressService.prepare({"web": policy}, str(tmp_path / "s"), lambda *_: None,
                                    secrets_file=path)
    assert service is not None
    assert service.injections == {"web": {"api.github.com": [("Authorization", "from-file")]}}
    monkeypatch.setenv("JAILD_UNIT_TOKEN", "from-env")
    again = EgressService.prepare({"web": policy}, str(tmp_path / "s"), lambda *_: None)
    assert again is not None and again.injections["web"]["api.github.com"][0][1] == "from-env"
    trust = Path(again.trust_path).read_text()
    assert again.ca.certificate_pem.decode().strip() in trust
    assert "from-env" not in trust and "from-file" not in trust
    assert Path(again.trust_path).stat().st_mode & 0o777 == 0o644
    key = tmp_path / "s" / "egress" / "ca" / "ca.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert key.parent.stat().st_mode & 0o777 == 0o700
    assert EgressService.prepare({"plain": load_policy_text("", "/p/plain.toml")},
                                 str(tmp_path), lambda *_: None) is None
