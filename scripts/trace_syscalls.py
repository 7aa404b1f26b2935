"""Derive the syscalls a corpus of real jobs makes, and compare them with a seccomp profile.

The default allow-list in ``jaild/policy/syscalls.py`` was checked against this
trace (``tests/corpus/*.py``: standard-library work, asyncio and threads,
subprocesses, numpy and pandas) rather than guessed. Rerun it after changing the
corpus or the profile:

    python scripts/trace_syscalls.py --env /var/lib/jaild/envs/data tests/corpus/*.py

It runs each file with the jail environment's interpreter under ``strace -f -c``
(outside any jail: the trace is of the workload, not of the sandbox), then
prints the union of syscalls seen and, for the chosen profile, which of them it
would refuse. The in-jail runtime's own calls (channel I/O, threads, exit) are
covered by the ``concurrency`` corpus file and by the integration tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaild.policy.seccomp import SeccompChoice, allowed_syscalls
from jaild.policy.syscalls import NEVER


def trace(python: str, file: Path) -> set[str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.txt"
        subprocess.run(
            ["strace", "-f", "-qq", "-c", "-o", str(out), python, "-I", str(file.resolve())],
            cwd=tmp, check=True, stdout=subprocess.DEVNULL,
        )
        names = set()
        for line in out.read_text().splitlines():
            parts = line.split()
            if parts and parts[-1].isidentifier() and parts[-1] not in ("syscall", "total"):
                names.add(parts[-1])
        return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="/var/lib/jaild/envs/data")
    parser.add_argument("--profile", default="default")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    python = f"{args.env}/bin/python3"
    seen: set[str] = set()
    for f in args.files:
        names = trace(python, f)
        print(f"{f.name}: {len(names)} syscalls")
        seen |= names
    plain, conditional = allowed_syscalls(SeccompChoice(args.profile, "kill", (), ()))
    allowed = plain | conditional
    print(f"\nunion: {len(seen)} syscalls\n{' '.join(sorted(seen))}")
    refused = sorted(seen - allowed)
    print(f"\nrefused by profile {args.profile!r}: {' '.join(refused) or '(none)'}")
    for name in refused:
        if name in NEVER:
            print(f"  {name}: never allowed ({NEVER[name]})")
    return 1 if [n for n in refused if n not in NEVER] else 0


if __name__ == "__main__":
    sys.exit(main())
