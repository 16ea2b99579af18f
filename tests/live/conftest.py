"""The live-rank tests' shared pair of ranks: one per test module, closed after it."""

from __future__ import annotations

import pytest

import dtlib


@pytest.fixture(scope="module")
def ranks():
    live = dtlib.LiveRanks(2, backend="gloo", timeout=60)
    try:
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def unchecked():
    """Live ranks without the collective check (``%ranks start N --no-check``): a mismatch hangs, as in a job."""
    live = dtlib.LiveRanks(2, backend="gloo", timeout=60, check_collectives=False)
    try:
        yield live
    finally:
        live.close()
