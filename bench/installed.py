"""Exit 0 if every requirement of jaild's ``[bench]`` extra is installed at a version it
allows, else 1 naming what is missing: ``make bench-tools`` runs pip only then.

Usage: python bench/installed.py [EXTRA]
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def unmet(extra: str) -> list[str]:
    """The requirements of jaild's ``extra`` not satisfied by what is installed."""
    out = []
    for line in metadata.requires("jaild") or []:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        wanted = f"{requirement.name}{requirement.specifier}"
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            out.append(f"{wanted} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            out.append(f"{wanted} (installed: {version})")
    return out


def main(argv: list[str]) -> int:
    missing = unmet(argv[0] if argv else "bench")
    for requirement in missing:
        print(f"missing: {requirement}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
