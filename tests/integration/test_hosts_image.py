"""The real-host harness's image build leaves the host's mount table as it was: each build
command mounts in a namespace of its own (hosts/image.py: PRIVATE_MOUNTS). CI builds the image
beside `make test`, whose hostile suite checks its daemon's mount table before and after.

Each test mounts only under its own temporary directory, so that is where the host's table is
looked at: what another suite mounts meanwhile elsewhere (its containers, its jails' network
namespaces) is not this test's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def image_module() -> ModuleType:
    name = "jaild_hosts_image"
    spec = importlib.util.spec_from_file_location(name, REPO / "hosts" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def mounts_under(directory: Path, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mount points at or below ``directory`` in a mount table (this process's: the
    host's)."""
    top = str(directory)
    points = [line.split()[4] for line in Path(mountinfo).read_text().splitlines()]
    return [p for p in points if p == top or p.startswith(top + "/")]


def test_a_build_commands_mounts_stay_in_its_own_namespace(tmp_path: Path) -> None:
    image = image_module()
    target = tmp_path / "rootfs-proc"
    target.mkdir()
    log = tmp_path / "build.log"
    assert mounts_under(tmp_path) == []
    # the command mounts and sees its mount there (the control: it really mounted, and
    # mounts_under finds it) ...
    image._call(["sh", "-c", f"mount -t tmpfs tmpfs {target} && grep -c ' {target} ' "
                 f"/proc/self/mountinfo && cp /proc/self/mountinfo {tmp_path}/seen"],
                log, None, "a mount")
    assert log.read_text().splitlines()[-1] == "1"
    assert mounts_under(tmp_path, str(tmp_path / "seen")) == [str(target)]
    # ... and the host never does, during or after
    assert mounts_under(tmp_path) == []


def test_a_killed_build_commands_mounts_go_with_it(tmp_path: Path) -> None:
    image = image_module()
    target, seen = tmp_path / "dev", tmp_path / "seen"
    target.mkdir()
    assert mounts_under(tmp_path) == []
    # the chroot's own mount of /dev, and a SIGKILL: nothing of the harness's runs after it
    with pytest.raises(RuntimeError, match="failed with exit -9"):
        image._call(["sh", "-c", f"mount --rbind /dev {target} && ls {target} > {seen} && "
                     "kill -9 $$"], tmp_path / "build.log", None, "a killed build")
    assert "null" in seen.read_text().split()  # the control: /dev was mounted there
    assert mounts_under(tmp_path) == []
    assert not any(target.iterdir()), "the host's /dev is reachable under the build's tree"


def test_a_build_command_past_its_deadline_is_overdue(tmp_path: Path) -> None:
    image = image_module()
    with pytest.raises(image.Overdue, match="a hung build was still running at the deadline"):
        image._call(["sleep", "600"], tmp_path / "build.log", 0.0, "a hung build")
