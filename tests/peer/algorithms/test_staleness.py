"""``gossip.max_staleness = "auto"``'s rule on figures, and how the bound follows its
measurements (tests/experiment/test_auto_staleness.py runs it over 100 ms RTT links)."""

from __future__ import annotations

import pytest
from gossipgrad.peer.algorithms.staleness import (
    HOLD,
    MAX_AUTO,
    MIN_ROUNDS,
    Staleness,
    staleness_for,
)
from gossipgrad.peer.config import GossipSection

pytestmark = pytest.mark.timeout(30)


def test_the_rule() -> None:
    assert staleness_for(0.020, 0.100) == 1  # under a quarter of a round
    assert staleness_for(0.008, 0.001) == 1  # under 10 ms: a LAN or one host
    assert staleness_for(0.100, 0.045) == 3  # ceil(2.2)
    assert staleness_for(0.100, 0.150) == 1  # diloco's phase covers the round trip
    assert staleness_for(0.100, 0.020) == MAX_AUTO == 4  # ceil(5), capped
    assert staleness_for(1.0, 0.010) == MAX_AUTO
    assert staleness_for(0.1, 0.0) == MAX_AUTO


def test_auto_follows_the_measurements_and_a_set_value_stays() -> None:
    assert GossipSection().max_staleness == "auto"
    auto = Staleness("auto")
    auto.observe_compute(0.05)
    assert auto.update(0.1) == 1  # too few rounds measured yet
    for seconds in [0.05] * (MIN_ROUNDS - 1) + [2.0]:  # a slow round does not move the median
        auto.observe_compute(seconds)
    assert auto.update(None) == 1  # no round trip yet
    assert auto.update(0.1) == 2
    # A choice holds HOLD rounds: a shorter round trip changes it only then.
    assert [auto.update(0.005) for _ in range(HOLD - 1)] == [2] * (HOLD - 1)
    assert auto.update(0.005) == 1
    fixed = Staleness(2)
    fixed.observe_compute(0.01)
    assert fixed.update(1.0) == 2
