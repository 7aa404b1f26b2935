"""The subtree's memory ceiling, written to a cgroup tree faked in a directory (no root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaild.daemon.jails import cgroups as cgroups_module
from jaild.daemon.jails.cgroups import Cgroups
from jaild.errors import CgroupError
from jaild.policy.compile import CgroupLayout

UNLIMITED = "9223372036854771712"


@pytest.fixture(autouse=True)
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Writes replace a file's content, as a cgroup file's do; their order is recorded."""
    seen: list[str] = []

    def write(path: str, value: str) -> None:
        if not Path(path).is_file():
            raise IsADirectoryError(21, "Is a directory", path)
        Path(path).write_text(value)
        seen.append(Path(path).name)

    monkeypatch.setattr(cgroups_module, "_write", write)
    return seen


def v1(tmp_path: Path, memsw: str | None = UNLIMITED) -> tuple[Cgroups, Path]:
    root = tmp_path / "memory" / "jaild-x"
    root.mkdir(parents=True)
    for name, value in (("memory.use_hierarchy", "1"), ("memory.limit_in_bytes", UNLIMITED)):
        (root / name).write_text(value)
    if memsw is not None:
        (root / "memory.memsw.limit_in_bytes").write_text(memsw)
    layout = CgroupLayout(1, "jaild-x", v1_bases=(("memory", str(tmp_path / "memory")),))
    return Cgroups(layout), root


def test_v1_sets_memory_and_memsw_on_the_subtree(tmp_path: Path, writes: list[str]) -> None:
    cgroups, root = v1(tmp_path)
    cgroups.limit_memory(1024)
    # lowering: memory first, so memsw is never below it
    assert writes == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    assert (root / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (root / "memory.memsw.limit_in_bytes").read_text() == str(1 << 30)
    assert cgroups.memory_limit_bytes() == 1 << 30
    writes.clear()
    cgroups.limit_memory(4096)  # raising: memsw first
    assert writes == ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
    assert cgroups.memory_limit_bytes() == 4 << 30


def test_v1_without_swap_accounting_sets_memory_only(tmp_path: Path) -> None:
    cgroups, root = v1(tmp_path, memsw=None)
    cgroups.limit_memory(512)
    assert (root / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert not (root / "memory.memsw.limit_in_bytes").exists()


def test_v1_a_refused_limit_fails_naming_the_key(tmp_path: Path) -> None:
    cgroups, root = v1(tmp_path)
    # the kernel refuses the limit (a directory stands in for the file): the error names it
    (root / "memory.limit_in_bytes").unlink()
    (root / "memory.limit_in_bytes").mkdir()
    with pytest.raises(CgroupError, match=r"cannot set the memory ceiling of .*jaild-x to "
                                          r"512 MiB \(limits.max_memory_mb\)"):
        cgroups.limit_memory(512)


def test_v2_sets_memory_max_and_no_swap(tmp_path: Path) -> None:
    root = tmp_path / "jaild-x"
    root.mkdir()
    (root / "memory.max").write_text("max")
    (root / "memory.swap.max").write_text("max")
    cgroups = Cgroups(CgroupLayout(2, "jaild-x", v2_root=str(tmp_path)))
    assert cgroups.memory_limit_bytes() is None
    cgroups.limit_memory(2048)
    assert (root / "memory.max").read_text() == str(2048 << 20)
    assert (root / "memory.swap.max").read_text() == "0"
    assert cgroups.memory_limit_bytes() == 2048 << 20
