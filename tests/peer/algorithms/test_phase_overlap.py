"""``gossip.overlap = "auto"`` (diloco): the rule on figures, and how the choice
follows its measurements (tests/experiment/test_auto_overlap.py runs it over 100 ms RTT
links)."""

from __future__ import annotations

import pytest
from gossipgrad.peer.algorithms.phase_overlap import MIN_PHASES, PhaseOverlap, overlap_for
from gossipgrad.peer.config import GossipSection

pytestmark = pytest.mark.timeout(30)


def test_the_rule() -> None:
    assert overlap_for(0.100, 0.150)  # 8 WAN sites: a one-way trip is a third of a phase
    assert overlap_for(0.100, 0.390)  # a slower phase: still over a quarter
    assert not overlap_for(0.100, 0.500)  # a quarter of a phase or less: not worth a phase
    assert not overlap_for(0.008, 0.020)  # under 10 ms: a LAN or one host
    assert not overlap_for(0.004, 0.133)  # the 8 sites on ideal links (measured)


def test_auto_turns_on_once_measured_and_a_set_value_stays() -> None:
    assert GossipSection(algorithm="diloco").overlap is False  # not the default (BENCHMARKS.md)
    assert GossipSection(algorithm="diloco", overlap="auto").overlap == "auto"
    auto = PhaseOverlap("auto")
    assert auto.update(0.1) is False  # no phase measured yet
    for _ in range(MIN_PHASES - 1):
        auto.observe_compute(0.15)
    assert auto.update(0.1) is False  # too few phases
    auto.observe_compute(5.0)  # a slow phase does not move the median
    assert auto.update(None) is False  # no round trip yet
    assert auto.update(0.1) is True
    assert auto.update(0.001) is True  # on for the run
    lan = PhaseOverlap("auto")
    for _ in range(MIN_PHASES):
        lan.observe_compute(0.15)
    assert lan.update(0.004) is False
    assert PhaseOverlap(False).update(1.0) is False
    assert PhaseOverlap(True).update(None) is True
