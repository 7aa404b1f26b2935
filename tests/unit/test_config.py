"""The daemon config file: validation, precedence, and the docs' reference table."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaild.daemon.config import (
    DaemonConfig,
    config_reference_markdown,
    default_policies_dir,
    load_config_file,
)
from jaild.errors import PolicyError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "jaild.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[limits]\nmax_jobs = 0", "limits.max_jobs: must be between 1 and 65536, got 0"),
        ("[limits]\nframe_timeout_s = 'x'", "limits.frame_timeout_s: must be a number, got 'x'"),
        ("[daemon]\nsocket = 'relative.sock'", "daemon.socket: must be an absolute path, got 'relative.sock'"),
        ("[daemon]\nsockett = '/x'", "daemon.sockett: unknown key; [daemon] accepts socket, socket_group"),
        ("[daemon]\nevent_loop = 'trio'",
         "daemon.event_loop: must be one of 'asyncio', 'uvloop', 'auto', got 'trio'"),
        ("[daemon]\nsched_slice_us = 50",
         "daemon.sched_slice_us: must be 0 (the kernel's default) or between 100 and 100000, got 50"),
        ("[access]\nusers = 'root'", "access.users: must be a list, got str"),
        ("[extra]", "extra: unknown key; the config accepts daemon, access, tls, limits"),
        ("[limits", "not valid TOML"),
        ("[tls]\nscoped_client_cas = ['ca.crt=spiffe://x/*']",
         "tls.scoped_client_cas: each entry must be \"/ABSOLUTE/FILE=PRINCIPAL-PATTERN\""),
        ("[tls]\nscoped_client_cas = ['/ca.crt=']",
         "tls.scoped_client_cas: each entry must be \"/ABSOLUTE/FILE=PRINCIPAL-PATTERN\""),
        ("[daemon]\nlisten = ['tls://127.0.0.1:0']\n[tls]\ncert = '/c'\nkey = '/k'",
         "tls.client_ca: must be set (or tls.scoped_client_cas)"),
        ("[limits]\napprovals_parked_max_count = 0",
         "limits.approvals_parked_max_count: must be between 1 and 1048576, got 0"),
        ("[limits]\napprovals_journal_quota_mb = 1.5",
         "limits.approvals_journal_quota_mb: must be an integer, got 1.5"),
        ("[access]\nslot_resource = 'slots'",
         "access.slot_resource: must be \"\" or an extended resource name such as "
         "\"jaild.dev/slots\", got 'slots'"),
        ("[access]\nslot_resource = 'kubernetes.io/cpu'", "access.slot_resource: must be"),
    ],
)
def test_config_errors_name_file_key_and_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_config_file(write(tmp_path, text))
    assert message in info.value.message
    assert info.value.message.startswith(str(tmp_path))


def test_precedence_defaults_file_environment_flags(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[daemon]\nsocket = "/file.sock"\nstate_dir = "/file/state"\n'
                           '[limits]\nmax_jobs = 7\n[access]\nusers = ["root"]\n')
    monkeypatch.delenv("JAILD_SOCKET", raising=False)
    monkeypatch.delenv("JAILD_STATE_DIR", raising=False)
    cfg = DaemonConfig.from_sources(path)
    assert (cfg.socket_path, cfg.state_dir, cfg.max_jobs, cfg.allowed_users) == (
        "/file.sock", "/file/state", 7, ("root",))
    assert (cfg.approvals_parked_max_count, cfg.approvals_journal_quota_mb) == (32, 256)
    quotas = write(tmp_path, "[limits]\napprovals_parked_max_count = 2\n"
                             "approvals_journal_quota_mb = 1\n")
    cfg = DaemonConfig.from_sources(quotas)
    assert (cfg.approvals_parked_max_count, cfg.approvals_journal_quota_mb) == (2, 1)
    assert cfg.slot_resource == "jaild.dev/slots"  # the default
    slots = write(tmp_path, '[access]\nslot_resource = "example.com/jails"\n')
    assert DaemonConfig.from_sources(slots).slot_resource == "example.com/jails"
    assert DaemonConfig.from_sources(write(tmp_path, '[access]\nslot_resource = ""\n')
                                     ).slot_resource == ""
    monkeypatch.setenv("JAILD_SOCKET", "/env.sock")
    assert DaemonConfig.from_sources(path).socket_path == "/env.sock"
    assert DaemonConfig.from_sources(path, socket_path="/flag.sock").socket_path == "/flag.sock"
    assert DaemonConfig.from_sources(path, socket_path=None).socket_path == "/env.sock"


def test_defaults_without_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JAILD_CONFIG", write(tmp_path, ""))
    cfg = DaemonConfig.from_sources()
    assert cfg.max_jobs == 512 and cfg.frame_timeout_s == 30.0 and cfg.allowed_users == ("*",)


def test_instances_do_not_share_cgroups_or_uids() -> None:
    a = DaemonConfig(socket_path="/run/a.sock")
    b = DaemonConfig(socket_path="/run/b.sock")
    default = DaemonConfig()
    assert len({a.subtree, b.subtree, default.subtree}) == 3
    assert default.subtree == "jaild"
    assert len({a.uid_base, b.uid_base, default.uid_base}) == 3
    assert all(c.uid_base >= 0x4000_0000 and c.uid_base + 65536 < 2**32 for c in (a, b, default))


def test_the_docs_config_reference_is_generated() -> None:
    assert config_reference_markdown() in (REPO / "docs/running/configuration.md").read_text(), (
        "run: python scripts/update_doc_references.py"
    )


def test_a_config_file_that_leaves_policies_dir_unset_keeps_its_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defaults compose: a file setting only another key does not move the policy directory
    away from where it is without a file (/etc/jaild/policies if it exists, else the
    checkout's)."""
    monkeypatch.delenv("JAILD_POLICIES", raising=False)
    path = tmp_path / "jaild.toml"
    path.write_text('[daemon]\nmetrics_address = "127.0.0.1:9464"\n')
    with_file = DaemonConfig.from_sources(str(path))
    assert with_file.metrics_address == "127.0.0.1:9464"
    assert with_file.policies_dir == default_policies_dir()
    path.write_text('[daemon]\npolicies_dir = "/srv/policies"\n')
    assert DaemonConfig.from_sources(str(path)).policies_dir == "/srv/policies"
