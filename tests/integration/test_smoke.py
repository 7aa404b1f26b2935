from __future__ import annotations

import pytest

from tests.conftest import DaemonHandle

pytestmark = pytest.mark.integration


def test_trivial_job(daemon: DaemonHandle) -> None:
    daemon.assert_serving()
