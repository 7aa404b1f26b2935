"""bench/soak.py's daemon config: one uid's burst of concurrent jobs passes admission (the
per-uid memory share came in after the soak was written, and its first burst of 200 came
back Busy), while the memory ceiling stays the derived one."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from jaild.daemon.config import DaemonConfig
from jaild.daemon.core.admission import Held, Load, check_capacity
from jaild.daemon.core.peer import Principal
from jaild.daemon.sessions import capacity
from jaild.errors import Busy
from jaild.testing import daemon_thread
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import soak

CEILING_MB = 18_078  # 3/4 of a 24 GiB host's MemTotal: the host where the soak came back Busy


def admitted(config: DaemonConfig, jobs: int, memory_mb: int) -> int:
    """How many of ``jobs`` jobs of one uid on one connection, sent at once, admission lets in."""
    caps = capacity(config)
    for n in range(jobs):
        held = Held(jails=n, memory_mb=n * memory_mb)
        try:
            check_capacity(Principal.of_uid(0), Load(daemon=held, uid=held, on_connection=n), caps, memory_mb)
        except Busy:
            return n
    return jobs


def soak_daemon(tmp_path: Path, burst: int, memory_mb: int, ceiling_mb: int) -> DaemonConfig:
    """The soak daemon's config, as ``jaild serve --config`` reads it, on a host whose derived
    ceiling is ``ceiling_mb``."""
    path = tmp_path / "jaild.toml"
    path.write_text(soak.soak_config(burst, memory_mb, ceiling_mb))
    config = DaemonConfig.from_sources(str(path))
    assert config.max_memory_mb == 0  # the ceiling stays the derived one, pinned here:
    return dataclasses.replace(config, max_memory_mb=ceiling_mb)


def test_the_soak_daemon_admits_a_whole_burst_of_the_default_policy(tmp_path: Path) -> None:
    memory_mb = 256  # policies/default.toml
    # the control: with the derived share, the burst is cut short (a Busy is a lost result)
    assert admitted(DaemonConfig(max_memory_mb=CEILING_MB), 200, memory_mb) == 141
    assert admitted(soak_daemon(tmp_path, 200, memory_mb, CEILING_MB), 200, memory_mb) == 200
    # no more than the burst: the share is the burst's limits, not a way around admission
    assert admitted(soak_daemon(tmp_path, 200, memory_mb, CEILING_MB), 201, memory_mb) == 200


@pytest.mark.parametrize("ceiling_mb", [1536, 6144, 96_000])
def test_the_burst_fits_on_a_small_host_and_a_large_one(tmp_path: Path, ceiling_mb: int) -> None:
    config = soak_daemon(tmp_path, 300, 256, ceiling_mb)
    assert admitted(config, 300, 256) == 300
    assert config.memory_overcommit >= 4.0  # raised only where the burst needs it


def test_a_host_too_small_for_the_burst_is_told_so() -> None:
    with pytest.raises(SystemExit, match="use a smaller --burst-size"):
        soak.soak_config(200, 256, 512)


@pytest.mark.parametrize(("share_mb", "lost"), [(4 * 256, 0), (100, 4)])
def test_a_refused_job_of_a_burst_is_a_lost_result(share_mb: int, lost: int) -> None:
    """A Busy is counted, not a crash of the soak nor a pass: against a daemon (jaild.testing's,
    no root) whose share for the uid is under one job's limit, every job of the burst is
    lost; the control, with room for the burst, loses none."""
    config = DaemonConfig(socket_path="<soak>", probe_policies=False, max_memory_mb=4096,
                          max_memory_mb_per_uid=share_mb)
    with daemon_thread({"default": "[limits]\nmemory_mb = 256\n"}, config=config) as d:
        assert asyncio.run(soak.burst(d.socket_path, 4, 0)) == lost


@pytest.mark.parametrize(
    "samples",
    [
        [136, 136, 134, 132, 131, 130, 130],  # falling: what failed the equality check
        [129] * 17,  # flat
        [153, 129, 129, 129, 129],  # the warm-up's peak, then flat
        [130, 131, 130, 132, 130, 131, 130, 131, 130],  # wobbling around a level
        [130, 130, 130, 130, 130, 131],  # one descriptor up in the last sample alone
        [140, 130, 131, 132, 133, 134],  # growing, but not past the warm-up's peak
    ],
)
def test_descriptors_that_fall_hold_or_wobble_are_no_leak(samples: list[int]) -> None:
    assert not soak.descriptors_grew(samples)


@pytest.mark.parametrize(
    "samples",
    [
        list(range(130, 147)),  # one more every sample, over a sequential run's 17
        [129, 131, 133, 135, 137],  # the sessions: before them and after each of 4 parts
        [130, 130, 130, 131, 132, 133, 134, 135, 136],  # flat, then climbing
        [136, 130, 131, 133, 135, 137, 139, 141, 143],  # climbing past the warm-up's peak
    ],
)
def test_descriptors_growing_across_the_run_are_a_leak(samples: list[int]) -> None:
    assert soak.descriptors_grew(samples)


def test_too_few_descriptor_samples_are_not_judged() -> None:
    with pytest.raises(ValueError, match="needs 3 or more"):
        soak.descriptors_grew([130, 131])
