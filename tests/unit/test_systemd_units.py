"""The shipped systemd units load cleanly and keep their security-relevant settings.

``systemd-analyze verify`` needs no running systemd. The units name the installed
executable (/opt/jaild/venv/bin/jaild), which a development machine usually
lacks, and verify rejects a missing ExecStart binary; so the units are verified
as copies in a temporary directory whose only change is ExecStart pointing at
this venv's ``jaild`` console script.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from jaild.daemon.config import DEFAULT_SOCKET

UNITS_DIR = Path(__file__).resolve().parents[2] / "systemd"
SERVICE = UNITS_DIR / "jaild.service"
SOCKET = UNITS_DIR / "jaild.socket"
INSTALLED_JAILD = "/opt/jaild/venv/bin/jaild"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")

# Settings jaild.service deliberately leaves out: each breaks nsjail or the daemon
# (or buys nothing); the reasons are in the unit file.
NOT_SET = {
    "PrivateUsers", "RestrictNamespaces", "ProtectKernelTunables", "ProtectKernelLogs",
    "ProtectProc", "ProcSubset", "ProtectControlGroups", "ProtectHostname", "PrivateDevices",
    "ProtectClock", "DevicePolicy", "PrivateNetwork", "IPAddressDeny", "MemoryDenyWriteExecute",
}
# Capabilities nsjail or the daemon use; the bounding set must keep them.
NEEDED_CAPABILITIES = {
    "CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SYSLOG", "CAP_KILL", "CAP_DAC_OVERRIDE",
}



def require_systemd_analyze() -> str:
    assert SYSTEMD_ANALYZE is not None, (
        "systemd-analyze is missing: apt-get install systemd (make test installs it)"
    )
    return SYSTEMD_ANALYZE


def settings(path: Path) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values, in order (systemd allows repeated keys)."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a Key=Value line: {raw!r}"
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def one(conf: dict[tuple[str, str], list[str]], section: str, key: str) -> str:
    values = conf.get((section, key))
    assert values is not None, f"[{section}] {key}= is missing"
    assert len(values) == 1, f"[{section}] {key}= is set {len(values)} times: {values}"
    return values[0]


def test_console_script_exists() -> None:
    """The executable the test copies of the units point at (pip install -e . makes it)."""
    assert (Path(sys.executable).parent / "jaild").is_file(), "reinstall: pip install -e ."


def copy_units(directory: Path, service_text: str | None = None,
               socket_text: str | None = None) -> list[Path]:
    """Copies of both units, ExecStart pointing at this venv's jaild."""
    local_jaild = str(Path(sys.executable).parent / "jaild")
    service_text = service_text if service_text is not None else SERVICE.read_text()
    rewritten, count = re.subn(rf"^ExecStart={re.escape(INSTALLED_JAILD)}( |$)",
                               f"ExecStart={local_jaild}\\1", service_text, flags=re.M)
    assert count == 1, f"jaild.service must have exactly one ExecStart={INSTALLED_JAILD} line"
    (directory / "jaild.service").write_text(rewritten)
    (directory / "jaild.socket").write_text(
        socket_text if socket_text is not None else SOCKET.read_text())
    return [directory / "jaild.socket", directory / "jaild.service"]


def verify(units: list[Path]) -> tuple[int, list[str]]:
    """Exit status of ``systemd-analyze verify`` and its complaints about these units."""
    analyze = require_systemd_analyze()
    directory = units[0].parent
    # Our directory first, so Service=jaild.service resolves to the copy; the
    # trailing ':' keeps the standard paths (sockets.target, multi-user.target).
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{directory}:", "SYSTEMD_LOG_COLOR": "0",
           "SYSTEMD_PAGER": ""}
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    about_us = [ln for ln in lines if "jaild" in ln or str(directory) in ln]
    return proc.returncode, about_us


def test_units_verify_cleanly(tmp_path: Path) -> None:
    code, complaints = verify(copy_units(tmp_path))
    assert code == 0, complaints
    assert complaints == []


def test_verify_check_catches_mistakes(tmp_path: Path) -> None:
    """Positive control: the check above would see a typo, a bad value, a broken link."""
    service = SERVICE.read_text().replace("\nDelegate=yes", "\nDelegat=yes").replace(
        "\nKillMode=mixed", "\nKillMode=mixd")
    code, complaints = verify(copy_units(tmp_path, service_text=service))
    assert any("Delegat" in c for c in complaints), complaints
    assert any("mixd" in c for c in complaints), complaints

    socket = SOCKET.read_text().replace("Service=jaild.service", "Service=jaild-nosuch.service")
    code, complaints = verify(copy_units(tmp_path, socket_text=socket))
    assert code != 0
    assert any("jaild-nosuch.service" in c for c in complaints), complaints


def test_service_settings() -> None:
    conf = settings(SERVICE)
    s = "Service"
    assert one(conf, s, "Type") == "notify"
    assert one(conf, s, "NotifyAccess") == "main"
    # No --socket: the daemon's default must be where jaild.socket listens.
    assert one(conf, s, "ExecStart") == f"{INSTALLED_JAILD} serve"
    assert one(conf, s, "Delegate") == "yes"
    assert one(conf, s, "KillMode") == "mixed"
    stop = one(conf, s, "TimeoutStopSec")
    assert stop.endswith("s") and int(stop[:-1]) >= 15, "must cover the 10 s cancel grace"
    assert one(conf, s, "OOMPolicy") == "continue"
    assert int(one(conf, s, "LimitNOFILE")) >= 65536
    assert one(conf, s, "RuntimeDirectory") == "jaild"
    assert one(conf, s, "RuntimeDirectoryMode") == "0750"
    assert one(conf, s, "RuntimeDirectoryPreserve") == "yes"
    assert one(conf, s, "StateDirectory") == "jaild"
    assert one(conf, s, "StateDirectoryMode") == "0755"  # the jailed uid traverses it
    assert one(conf, s, "ConfigurationDirectory") == "jaild"
    assert one(conf, s, "UMask") == "0022"
    assert one(conf, s, "NoNewPrivileges") == "yes"
    assert one(conf, s, "ProtectSystem") == "strict"
    assert one(conf, s, "SystemCallArchitectures") == "native"

    present = {key for (section, key) in conf if section == s}
    assert not present & NOT_SET, sorted(present & NOT_SET)
    # Outer layers that every jail inherits, checked in the Debian 12 guest (make test-hosts):
    # nsjail configures a jail's loopback over netlink; policies with a network need AF_INET*.
    assert set(one(conf, s, "RestrictAddressFamilies").split()) == {
        "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    denied = one(conf, s, "SystemCallFilter")
    assert denied.startswith("~"), "a deny-list: nsjail needs mount, pivot_root, unshare, setns"
    assert not set(denied[1:].split()) & {"@mount", "@privileged", "@process", "@setuid",
                                           "@system-service", "@resources", "@basic-io"}
    assert one(conf, s, "PrivateIPC") == "yes"
    bounding = one(conf, s, "CapabilityBoundingSet")
    assert bounding.startswith("~"), "a deny-list: nsjail needs most of root's capabilities"
    assert not set(bounding[1:].split()) & NEEDED_CAPABILITIES

    # The service must also work without the socket unit.
    for key in ("Requires", "BindsTo", "Requisite"):
        assert "jaild.socket" not in " ".join(conf.get(("Unit", key), []))
    assert one(conf, "Install", "WantedBy") == "multi-user.target"


def test_socket_settings() -> None:
    conf = settings(SOCKET)
    s = "Socket"
    assert one(conf, s, "ListenStream") == DEFAULT_SOCKET
    assert one(conf, s, "SocketMode") == "0660"
    assert one(conf, s, "DirectoryMode") == "0750"
    assert one(conf, s, "SocketUser") == "root"
    assert one(conf, s, "SocketGroup") == "root"
    assert one(conf, s, "Accept") == "no"  # one daemon for every connection
    assert one(conf, s, "Service") == "jaild.service"
    assert one(conf, "Install", "WantedBy") == "sockets.target"
