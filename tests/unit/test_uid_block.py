"""The jails' ids stay clear of the kubelet's subordinate-id ranges (pods with user
namespaces are mapped into them): the rule, read from the files."""

from __future__ import annotations

from pathlib import Path

from jaild.daemon.selftest import UID_BLOCK, subid_overlaps, uid_block_check

BASE = 0x4000_0000


def test_a_kubelet_range_meeting_the_block_is_found_at_either_end() -> None:
    text = "\n".join([
        "# a comment, and a malformed line",
        "kubelet:x:y",
        f"kubelet:{BASE - 10}:10",  # ends just below: clear
        f"kubelet:{BASE - 10}:11",  # its last id is the block's first
        f"kubelet:{BASE + UID_BLOCK - 1}:5",  # starts on the block's last id
        f"kubelet:{BASE + UID_BLOCK}:65536",  # just above: clear
        f"alice:{BASE}:65536",  # not the kubelet's
    ])
    assert subid_overlaps(text, BASE, UID_BLOCK) == [
        (4, "kubelet", BASE - 10, 11),
        (5, "kubelet", BASE + UID_BLOCK - 1, 5),
    ]


def test_the_check_names_each_file_and_line(tmp_path: Path) -> None:
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text("kubelet:65536:7208960\n")  # the kubelet's usual range: clear
    subgid.write_text(f"root:1:2\nkubelet:{BASE + 100}:65536\n")
    check = uid_block_check(BASE, (str(subuid), str(subgid), str(tmp_path / "missing")))
    assert not check.ok
    assert check.detail == (f"ids {BASE}..{BASE + UID_BLOCK - 1} overlap "
                            f"{subgid}:2 kubelet:{BASE + 100}:65536")
    assert "another socket path" in check.fix
    subgid.write_text("kubelet:65536:7208960\n")  # the control: the same files, clear
    assert uid_block_check(BASE, (str(subuid), str(subgid))).ok
