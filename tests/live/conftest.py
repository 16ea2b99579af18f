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


@pytest.fixture(autouse=True)
def no_stepped_cell_outlives_its_test(request):
    """A test that fails while a stepped cell is paused would leave it to the next test on the module's shared
    ranks, which then fails for no fault of its own: end it, whatever the test's outcome."""
    yield
    for name in ("ranks", "unchecked"):
        if name in request.fixturenames:
            live = request.getfixturevalue(name)
            if live.paused:
                try:
                    live.abort()
                except Exception:  # noqa: BLE001 - the test's own failure is the one to report
                    pass


@pytest.fixture
def needs_the_check(ranks):
    """The shared ranks, where this torch's collective check works (``compat.collective_check_works``); else the
    test is skipped, as the live ranks then run unchecked by default."""
    if not ranks.check_collectives:
        pytest.skip("this torch's collective check does not work here, so live ranks run unchecked")
    return ranks
