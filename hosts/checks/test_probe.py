import subprocess


def test_placeholder() -> None:
    assert subprocess.run(["true"]).returncode == 0
