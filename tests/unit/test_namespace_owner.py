"""Who owns a jail's user namespace: the launcher prefix that starts nsjail as that uid."""

from __future__ import annotations

import pytest

from jaild.daemon.jails.launch.spawned import as_owner, owner_caps

LAUNCHER = ("/usr/bin/setpriv", "--pdeathsig", "TERM", "--")


def _permitted() -> int:
    with open("/proc/self/status") as status:
        return int(next(ln for ln in status if ln.startswith("CapPrm:")).split()[1], 16)


def test_nsjail_runs_as_the_owner_uid_with_the_daemons_capabilities() -> None:
    argv = as_owner(LAUNCHER, 1_073_741_824)
    # the parent-death signal stays; setpriv sets it after the change of uid
    assert argv[:3] == list(LAUNCHER[:3]) and argv[-1] == "--" and argv.count("--") == 1
    options = argv[3:-1]
    assert {"--reuid=1073741824", "--regid=1073741824", "--clear-groups"} <= set(options)
    assert "--securebits=+no_setuid_fixup" in options  # capabilities survive the uid change
    caps = owner_caps()
    assert f"--inh-caps={caps}" in options and f"--ambient-caps={caps}" in options


def test_the_capabilities_are_exactly_the_daemons_permitted_set() -> None:
    # as setpriv spells them: none, then each permitted one by number (a constant "+all"
    # fails where the bounding set lacks one, as CAP_SYS_RESOURCE on some hosts)
    first, *raised = owner_caps().split(",")
    assert first == "-all"
    assert sum(1 << int(c.removeprefix("+cap_")) for c in raised) == _permitted()


def test_a_launcher_that_is_not_setpriv_is_refused() -> None:
    for launcher in ((), ("/usr/bin/env",)):
        with pytest.raises(ValueError, match="setpriv"):
            as_owner(launcher, 1_073_741_824)
