"""The vocabulary of a peer's Prometheus metrics: the name prefix, the closed label-value
sets and the histogram buckets, shared by the exporter (``metrics.py``) and every reader.

Naming rule (Prometheus naming guide): every metric starts with ``gossipgrad_``, is in base
units (``_bytes``, ``_seconds``), counters end in ``_total``, no colons. Label values come from
closed sets -- message kind (:data:`MESSAGE_KINDS`), reject reason (``REJECT_REASONS`` of
``peer/network/errors.py``), peer state (:data:`PEER_STATES`) -- or from sets bounded by the
topology: ``neighbor`` is a neighbour's peer id, and a peer has only ``degree`` of them.
Tensor names, steps and rounds are never labels. Children of closed label sets are created
up front, so a failure series reads 0 before the first failure instead of being absent
(``rate()`` and alerts then work from the start).
"""

from __future__ import annotations

PREFIX = "gossipgrad"

#: Kinds of gossip messages, the ``kind`` label of the byte counters.
MESSAGE_KINDS: tuple[str, ...] = ("update", "resync", "state", "heartbeat", "buffers")

#: Membership states of the other peers as this peer sees them, the ``state`` label of ``peers``.
PEER_STATES: tuple[str, ...] = ("alive", "suspect", "dead")

#: ``neighbor`` value of traffic not tied to one neighbour: membership heartbeats go to and
#: come from any peer of the swarm, not only the gossip neighbours. Prometheus shows these
#: series without a ``neighbor`` label (an empty label value is an absent label).
UNATTRIBUTED = ""

#: ``neighbor`` value that keeps the counts of neighbours that left (never a peer id: ids
#: are letters, digits and ``_.-``).
DEPARTED = "(departed)"

#: Most distinct ``name`` values ``set_eval`` accepts: eval metric names come from the task
#: (accuracy, perplexity, ...), a handful; more means a caller is putting data into a label.
MAX_EVAL_METRICS = 16

# Bucket bounds in seconds. Rounds and pushes cross wide-area links (tens of ms to tens of s);
# compression of a large model on CPU takes from sub-millisecond to seconds.
ROUND_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
PUSH_BUCKETS: tuple[float, ...] = ROUND_BUCKETS
COMPRESS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
