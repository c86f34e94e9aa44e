"""``gossip.overlap = "auto"`` (diloco's default): the rule on figures, and how the choice
follows its measurements (tests/experiment/test_auto_overlap.py runs it over 100 ms RTT
links)."""

from __future__ import annotations

import pytest
from gossipgrad.peer.algorithms.phase_overlap import MIN_PHASES, PhaseOverlap, overlap_for
from gossipgrad.peer.algorithms.staleness import HOLD, MAX_AUTO, MIN_ROUNDS, Staleness
from gossipgrad.peer.config import GossipSection

pytestmark = pytest.mark.timeout(30)


def test_the_rule() -> None:
    assert overlap_for(0.100, 0.150)  # 8 WAN sites: a one-way trip is a third of a phase
    assert overlap_for(0.100, 0.390)  # a slower phase: still over a quarter
    assert not overlap_for(0.100, 0.500)  # a quarter of a phase or less: not worth a phase
    assert not overlap_for(0.008, 0.020)  # under 10 ms: a LAN or one host
    assert not overlap_for(0.004, 0.133)  # the 8 sites on ideal links (measured)


def test_auto_turns_on_once_measured_and_a_set_value_stays() -> None:
    assert GossipSection(algorithm="diloco").overlap == "auto"
    assert GossipSection(algorithm="diloco", overlap=False).overlap is False
    assert GossipSection(algorithm="exact-diloco").overlap is False
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


def test_overlap_gives_the_anchors_staleness_a_round_of_margin() -> None:
    # 100 ms round trip, 150 ms phases: the rule alone keeps 1, which paced the 8 WAN sites
    # whenever a neighbour's phase ended late; with overlap the anchors take 2.
    anchors = Staleness("auto")
    for _ in range(MIN_ROUNDS):
        anchors.observe_compute(0.15)
    assert anchors.update(0.1) == 1
    anchors.add_margin(1)
    assert anchors.update(0.1) == 2  # from the next round, not after a hold
    assert [anchors.update(0.1) for _ in range(HOLD)] == [2] * HOLD
    anchors.add_margin(1)  # once more: no change
    assert anchors.update(0.1) == 2
    far = Staleness("auto")
    for _ in range(MIN_ROUNDS):
        far.observe_compute(0.02)
    far.add_margin(1)
    assert far.update(0.1) == MAX_AUTO  # capped
    pinned = Staleness(1)
    pinned.add_margin(1)
    assert pinned.update(0.1) == 1  # a value the user set stays
