"""Fixtures only the integration tests use: network-namespace test beds."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_netbed():
    """``make_netbed(nodes, rate_mbit=...)`` builds a network-namespace test bed (``hetrain.testing.netbed``).

    Every bed it made is torn down after the test, whatever happened; skips where this machine
    cannot make network namespaces (not root, no iproute2).
    """
    from hetrain.testing import netbed as nb

    ok, why = nb.available()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    beds = []

    def make(nodes, rate_mbit=None):
        bed = nb.NetBed(list(nodes), rate_mbit=rate_mbit)
        beds.append(bed)
        return bed.up()

    yield make
    for bed in beds:
        bed.down()
