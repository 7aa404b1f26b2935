"""bench/stages.py's split: each warm job's six stages, and a job that found the pool empty
(a cold job: no RunCode written within its submit) left out instead of borrowing the next
job's notes (which made a stage negative on a slow guest)."""

from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import stages


def _warm(t: int, channel: int) -> list[tuple[int, str, int]]:
    return [(t + 1, "runjob read", 0), (t + 2, "runcode written", channel),
            (t + 3, "submit end", 0), (t + 5, "jail readable", channel),
            (t + 7, "jobfinished written", 0)]


def test_each_warm_job_splits_into_its_six_stages() -> None:
    daemon = _warm(100, 7) + _warm(200, 8)
    client = [(100, 108, 109), (200, 208, 209)]
    out = stages.split(client, daemon)
    assert list(out) == list(stages.STAGES)
    assert all(v == [1e-9, 1e-9, 3e-9, 2e-9, 1e-9, 1e-9] [i:i + 1] * 2
               for i, v in enumerate(out.values()))


def test_a_job_that_found_the_pool_empty_is_left_out() -> None:
    cold = [(101, "runjob read", 0), (102, "submit end", 0),  # nothing written in submit
            (150, "jail readable", 9), (160, "jail readable", 9),
            (170, "jobfinished written", 0)]
    daemon = cold + _warm(200, 8)
    client = [(100, 171, 172), (200, 208, 209)]
    out = stages.split(client, daemon)
    assert [len(v) for v in out.values()] == [1] * 6  # only the warm job
    assert min(min(v) for v in out.values()) >= 0
