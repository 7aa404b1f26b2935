"""``daemon.clone_into_cgroup`` measured on cgroup v2, in the Debian 12 guest: ``make
test-hosts HOSTS_ARGS="--profile ci --steps clone test --target setup --tests
hosts/bench_clone_in_guest.py"``.

Not part of any suite (it measures rather than checks): ``bench/clone_into.py``'s two
daemons, its report written to the run's share (``hosts/logs/<guest>/clone-into.md``).
Under TCG only the ratios between its two sides mean anything (docs/performance.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHARE = Path("/mnt/hosts")
REPO = Path(__file__).resolve().parent.parent


def test_clone_into_cgroup_on_cgroup_v2() -> None:
    assert Path("/sys/fs/cgroup/cgroup.controllers").exists(), "not a cgroup v2 host"
    out = SHARE / "clone-into.md" if SHARE.is_dir() else Path("/tmp/clone-into.md")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "clone_into.py"), "--rounds", "5",
         "--seconds", "4", "--runs", "30", "--out", str(out)],
        capture_output=True, text=True, check=False,
    )
    out.with_suffix(".log").write_text(done.stdout[-20000:] + done.stderr[-20000:])
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:]
