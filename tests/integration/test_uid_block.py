"""A daemon whose jail ids the kubelet hands to pods refuses to start, saying which line
of /etc/subuid; the same daemon with the kubelet's range elsewhere serves (the control).
Each daemon runs in a mount namespace of its own with a file of the test's bound over
/etc/subuid (the host's own file is never touched)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from jaild.daemon.config import DaemonConfig
from tests.conftest import free_socket, guard, start_daemon, sweep_cgroups


def wrapper(directory: Path, subuid_text: str) -> str:
    """An interpreter for start_daemon that runs python with ``subuid_text`` as /etc/subuid."""
    directory.mkdir(parents=True, exist_ok=True)
    subuid = directory / "subuid"
    subuid.write_text(subuid_text)
    script = directory / "python-with-subuid"
    script.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private -- "
        "sh -c 'mount --bind \"$0\" /etc/subuid && exec \"$@\"' "
        f"'{subuid}' '{sys.executable}' \"$@\"\n"
    )
    script.chmod(0o755)
    return str(script)


def test_a_daemon_whose_jail_ids_the_kubelet_hands_out_refuses_to_start(tmp_path: Path) -> None:
    sock = free_socket(tmp_path / "d")  # the block is named before the daemon starts
    base = DaemonConfig(socket_path=sock).uid_base
    python = wrapper(tmp_path / "w", f"kubelet:65536:7208960\nkubelet:{base + 4096}:65536\n")
    d = start_daemon(tmp_path / "d", wait=False, python=python, with_repo_policies=False,
                     policies={"default": ""}, socket=sock)
    assert d.proc.wait(timeout=guard(60)) != 0
    log = d.log()
    assert (f"cannot start: the jails' ids {base}..{base + 65535} overlap "
            f"/etc/subuid:2 kubelet:{base + 4096}:65536") in log, log[-2000:]
    assert "another socket path" in log


def test_positive_control_the_kubelets_range_elsewhere_lets_it_serve(tmp_path: Path) -> None:
    python = wrapper(tmp_path / "w", "kubelet:65536:7208960\n")
    d = start_daemon(tmp_path / "d", python=python, with_repo_policies=False,
                     policies={"default": ""})
    try:
        d.assert_serving()
    finally:
        assert d.stop(signal.SIGTERM) == 0, d.log()[-2000:]
        sweep_cgroups(d)
