"""The bench on cgroup v2, in the Debian 12 guest: ``make test-hosts HOSTS_ARGS="--profile ci
--steps clone test --tests hosts/bench_in_guest.py"``.

Not part of any suite (it is outside ``tests/``, and it measures rather than checks): a quick
``bench/compare.py`` run on the guest's systemd, cgroup v2 host, its report written to the
run's share, which the harness copies to ``hosts/logs/<guest>/bench-v2.md``. Under TCG every
figure is emulation's; only the report's ratios between rows of the same run mean anything
(docs/performance.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHARE = Path("/mnt/hosts")
REPO = Path(__file__).resolve().parent.parent


def test_the_bench_on_cgroup_v2() -> None:
    assert Path("/sys/fs/cgroup/cgroup.controllers").exists(), "not a cgroup v2 host"
    out = SHARE / "bench-v2.md" if SHARE.is_dir() else Path("/tmp/bench-v2.md")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare.py"), "--quick", "--runs", "30",
         "--seconds", "3", "--out", str(out)],
        capture_output=True, text=True, check=False,
    )
    (out.with_suffix(".log")).write_text(done.stdout[-20000:] + done.stderr[-20000:])
    assert out.exists(), done.stderr[-3000:]
