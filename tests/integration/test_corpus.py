"""Real workloads run under the default syscall profile with the *kill* action.

The corpus (tests/corpus) is what the default allow-list was checked against
with scripts/trace_syscalls.py; here it runs for real, in jails, through the daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DaemonHandle

pytestmark = pytest.mark.integration

CORPUS = Path(__file__).resolve().parents[1] / "corpus"


@pytest.mark.parametrize("name", ["stdlib_mix", "concurrency", "subprocesses"])
def test_corpus_runs_under_the_default_profile(daemon: DaemonHandle, name: str) -> None:
    r = daemon.run((CORPUS / f"{name}.py").read_text(), policy="default", timeout=20)
    assert r.status == "ok", (r.status, r.error)
    assert r.stdout.strip()


def test_numpy_and_pandas_under_the_default_profile(daemon: DaemonHandle) -> None:
    # tests/policies/data.toml: the default profile and action, with the numpy/pandas env
    r = daemon.run((CORPUS / "numpy_pandas.py").read_text(), policy="data", timeout=30)
    assert r.status == "ok", (r.status, r.error)
    assert r.stdout.startswith("(300, 300)")


def test_numpy_stays_within_the_memory_limit(daemon: DaemonHandle) -> None:
    code = (
        "import numpy as np\n"
        "a = np.ones((300, 300))\n"
        "b = a @ a\n"
        "try:\n"
        "    huge = np.ones((40000, 40000))\n"  # 12.8 GB: far over the 512 MB limit
        "    result = 'allocated?!'\n"
        "except MemoryError:\n"
        "    result = 'MemoryError'\n"
        "float(b[0, 0]), result"
    )
    # the policy's own wall-clock limit (60 s): under TCG on a loaded host the import and
    # the page faults up to the memory limit took more than 30 s
    r = daemon.run(code, policy="data")
    # numpy asks for the pages lazily: either it is refused, or the cgroup stops the job
    assert r.status in ("ok", "memory_limit"), (r.status, r.error)
    if r.status == "ok":
        assert r.result == [300.0, "MemoryError"]


def test_blas_threads_are_capped(daemon: DaemonHandle) -> None:
    r = daemon.run("import os\nos.environ['OPENBLAS_NUM_THREADS'], os.environ['OMP_NUM_THREADS']",
                   policy="data")
    assert r.result == ["1", "1"]
