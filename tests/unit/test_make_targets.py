"""The Makefile's system-facing targets, run against a scratch tree (issue 17, items 1 and 9).

``make bin-link`` (part of ``make setup``: ``jaild`` on root's PATH), ``make install``,
``make uninstall [PURGE=1]`` and ``make distclean`` are run for real, by ``make``, in a copy
of this checkout's Makefile, policies and units ("the checkout"), with every system path
(``OPT_DIR``, ``ETC_DIR``, ``UNIT_DIR``, ``BIN_DIR``, ``STATE_DIR``) pointed below a temporary
root. ``-o .stamps/venv``, ``-o .stamps/venv-core``, ``-o setup`` and ``-o jail-env`` keep make from
building a venv or the jail environments; the checkout's
``.venv/bin/jaild`` and ``python`` and the installed venv's ``python``, ``pip`` and ``jaild``
are stand-in scripts. systemctl is never run: the unit directory is not the system's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, guard

STAND_IN = "#!/bin/sh\nexit 0\n"


@dataclass
class Tree:
    """The temporary root the targets install into and remove from."""

    root: Path

    @property
    def opt(self) -> Path:
        return self.root / "opt" / "jaild"

    @property
    def etc(self) -> Path:
        return self.root / "etc" / "jaild"

    @property
    def policies(self) -> Path:
        return self.etc / "policies"

    @property
    def units(self) -> Path:
        return self.root / "etc" / "systemd" / "system"

    @property
    def link(self) -> Path:
        return self.root / "usr" / "local" / "bin" / "jaild"

    @property
    def state(self) -> Path:
        return self.root / "var" / "lib" / "jaild"

    def variables(self) -> list[str]:
        return [f"OPT_DIR={self.opt}", f"ETC_DIR={self.etc}", f"UNIT_DIR={self.units}",
                f"BIN_DIR={self.link.parent}", f"STATE_DIR={self.state}"]


def executable(path: Path, text: str = STAND_IN) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def checkout(where: Path) -> Path:
    """A copy of what the targets read from this checkout, with a built venv's jaild."""
    where.mkdir(parents=True)
    shutil.copy(REPO / "Makefile", where / "Makefile")
    shutil.copytree(REPO / "policies", where / "policies")
    shutil.copytree(REPO / "systemd", where / "systemd")
    executable(where / ".venv" / "bin" / "jaild")
    executable(where / ".venv" / "bin" / "python")  # `make install` runs its pip
    return where


def dev_jaild(co: Path) -> str:
    return str(co / ".venv" / "bin" / "jaild")


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    t = Tree(tmp_path / "root")
    t.units.mkdir(parents=True)
    t.link.parent.mkdir(parents=True)
    return t


@pytest.fixture
def co(tmp_path: Path) -> Path:
    return checkout(tmp_path / "clone-a")


def make(co: Path, tree: Tree, *args: str) -> str:
    """Runs make in the checkout; returns its output, failing the test on a non-zero exit."""
    # Nothing of an outer make's (`make test`) flags or variables.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-o", ".stamps/venv", "-o", ".stamps/venv-core",
         "-o", "setup", "-o", "jail-env", *args,
         *tree.variables()],
        cwd=co, env=env, capture_output=True, text=True, timeout=guard(60), check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"make {' '.join(args)} exited {proc.returncode}:\n{output}"
    assert "Error" not in output, output
    return output


# -- bin-link: `jaild` on PATH after make setup / make demo --------------------------------

def test_setup_links_jaild_where_there_is_none(co: Path, tree: Tree) -> None:
    out = make(co, tree, "bin-link")
    assert os.readlink(tree.link) == dev_jaild(co)
    assert out.strip() == f"jaild: linked {tree.link} -> {dev_jaild(co)} (this checkout's)"


def test_setup_again_keeps_the_link_and_says_whose_it_is(co: Path, tree: Tree) -> None:
    make(co, tree, "bin-link")
    out = make(co, tree, "bin-link")
    assert os.readlink(tree.link) == dev_jaild(co)
    assert out.strip() == f"jaild: {tree.link} -> {dev_jaild(co)} (this checkout's)"


def test_another_clones_working_link_is_left_alone(co: Path, tree: Tree,
                                                   tmp_path: Path) -> None:
    other = checkout(tmp_path / "clone-b")
    make(other, tree, "bin-link")
    out = make(co, tree, "bin-link")
    assert os.readlink(tree.link) == dev_jaild(other)
    assert f"-> {dev_jaild(other)}, left as it is" in out
    assert f"this checkout's is {dev_jaild(co)}" in out


def test_a_deleted_clones_dangling_link_is_replaced(co: Path, tree: Tree,
                                                    tmp_path: Path) -> None:
    other = checkout(tmp_path / "clone-b")
    make(other, tree, "bin-link")
    shutil.rmtree(other)
    out = make(co, tree, "bin-link")
    assert os.readlink(tree.link) == dev_jaild(co)
    assert f"replacing a dangling link to {dev_jaild(other)}" in out


def test_make_installs_link_is_left_alone(co: Path, tree: Tree) -> None:
    installed = executable(tree.opt / "venv" / "bin" / "jaild")
    tree.link.symlink_to(installed)
    out = make(co, tree, "bin-link")
    assert os.readlink(tree.link) == str(installed)
    assert f"-> {installed} (make install's), left as it is" in out


def test_a_file_of_its_own_is_left_alone(co: Path, tree: Tree) -> None:
    executable(tree.link, "#!/bin/sh\necho mine\n")
    out = make(co, tree, "bin-link")
    assert not tree.link.is_symlink() and "mine" in tree.link.read_text()
    assert "is not a link, left as it is" in out


def test_no_place_for_the_link_is_a_note_not_a_failure(co: Path, tree: Tree) -> None:
    tree.link.parent.rmdir()
    out = make(co, tree, "bin-link")
    assert f"could not link {tree.link}" in out and dev_jaild(co) in out


def test_distclean_removes_this_checkouts_link_only(co: Path, tree: Tree,
                                                   tmp_path: Path) -> None:
    make(co, tree, "bin-link")
    make(co, tree, "distclean")
    assert not tree.link.is_symlink() and not (co / ".venv").exists()

    other = checkout(tmp_path / "clone-b")
    make(other, tree, "bin-link")
    make(checkout(tmp_path / "clone-c"), tree, "distclean")
    assert os.readlink(tree.link) == dev_jaild(other)


# -- install and uninstall ------------------------------------------------------------------

def shipped() -> list[str]:
    return sorted(p.name for p in (REPO / "policies").glob("*.toml"))


def install(co: Path, tree: Tree) -> str:
    for name in ("python", "pip", "jaild"):
        executable(tree.opt / "venv" / "bin" / name)
    return make(co, tree, "install")


def test_uninstall_where_nothing_was_installed(co: Path, tree: Tree) -> None:
    out = make(co, tree, "uninstall")
    assert "jaild was not installed" in out


def test_install_then_uninstall_leaves_nothing(co: Path, tree: Tree) -> None:
    install(co, tree)
    assert os.readlink(tree.link) == str(tree.opt / "venv" / "bin" / "jaild")
    assert sorted(p.name for p in tree.policies.iterdir()) == shipped()
    assert (tree.units / "jaild.service").exists() and (tree.units / "jaild.socket").exists()
    wants = tree.units / "sockets.target.wants"
    wants.mkdir()
    (wants / "jaild.socket").symlink_to("../jaild.socket")  # as `systemctl enable` does

    out = make(co, tree, "uninstall")
    for gone in (tree.opt, tree.etc, tree.link, tree.units / "jaild.service",
                 tree.units / "jaild.socket", wants / "jaild.socket"):
        assert not gone.exists() and not gone.is_symlink(), (gone, out)
    assert "kept" not in out, out


def test_install_replaces_this_checkouts_own_link(co: Path, tree: Tree) -> None:
    make(co, tree, "bin-link")
    out = install(co, tree)
    installed = str(tree.opt / "venv" / "bin" / "jaild")
    assert os.readlink(tree.link) == installed
    assert f"install: linked {tree.link} -> {installed}, replacing {dev_jaild(co)}" in out


@pytest.mark.parametrize("whose", ["another clone's link", "a file"])
def test_install_and_uninstall_keep_what_they_did_not_make(
        co: Path, tree: Tree, tmp_path: Path, whose: str) -> None:
    if whose == "a file":
        executable(tree.link)
    else:
        make(checkout(tmp_path / "clone-b"), tree, "bin-link")
    before = os.readlink(tree.link) if tree.link.is_symlink() else tree.link.read_text()
    out = install(co, tree)
    assert f"install: kept {tree.link} (" in out
    after = os.readlink(tree.link) if tree.link.is_symlink() else tree.link.read_text()
    assert after == before
    out = make(co, tree, "uninstall")
    assert f"uninstall: kept {tree.link} (" in out
    assert (os.readlink(tree.link) if tree.link.is_symlink() else tree.link.read_text()) == before


def test_uninstall_keeps_the_operators_policies_and_config(co: Path, tree: Tree) -> None:
    install(co, tree)
    changed = tree.policies / shipped()[0]
    changed.write_text(changed.read_text() + "# the operator's change\n")
    (tree.policies / "mine.toml").write_text("[limits]\nwall_time_s = 5\n")
    (tree.etc / "jaild.toml").write_text("[daemon]\n")
    (tree.state / "envs").mkdir(parents=True)

    out = make(co, tree, "uninstall")
    assert sorted(p.name for p in tree.policies.iterdir()) == sorted([changed.name, "mine.toml"])
    assert (tree.etc / "jaild.toml").exists() and (tree.state / "envs").exists()
    assert not tree.opt.exists() and not tree.link.is_symlink()
    kept = " ".join(sorted([changed.name, "mine.toml"]))
    assert f"kept in {tree.policies}, changed or added since install: {kept}" in out
    assert f"kept in {tree.etc}: jaild.toml policies" not in out
    assert f"kept in {tree.etc}: jaild.toml" in out
    assert f"kept {tree.state}" in out and "PURGE=1" in out

    out = make(co, tree, "uninstall", "PURGE=1")
    assert not tree.etc.exists() and not tree.state.exists(), out
    assert "jaild was not installed" in make(co, tree, "uninstall")


def test_a_shipped_policy_is_unchanged_by_its_install_time_digest(co: Path, tree: Tree) -> None:
    """A policy the checkout has changed since the install is still removed as shipped:
    the install recorded the digest of what it wrote."""
    install(co, tree)
    name = shipped()[0]
    (co / "policies" / name).write_text("# a later version of the shipped policy\n")
    make(co, tree, "uninstall")
    assert not tree.etc.exists()


def test_install_keeps_a_policy_already_there(co: Path, tree: Tree) -> None:
    tree.policies.mkdir(parents=True)
    name = shipped()[0]
    (tree.policies / name).write_text("# the operator's own\n")
    install(co, tree)
    assert (tree.policies / name).read_text() == "# the operator's own\n"
    make(co, tree, "uninstall")
    assert [p.name for p in tree.policies.iterdir()] == [name]
