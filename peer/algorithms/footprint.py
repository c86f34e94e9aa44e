"""What each byte of a peer's gossip state is for: the memory an algorithm keeps beside the
model, its gradients and the user's optimizer, as a formula of the model's size.

Per peer, with M the model's bytes (float32 parameters), d the edges the peer keeps (its
neighbours: 2 on a ring of 3 or more, 1 on a ring of 2, n - 1 on a complete graph and on the
exponential graph up to 5 peers (about 2 log2 n beyond), and on a time-varying graph every
partner met since the last membership change) and c the copies'
size relative to the model (1 for ``gossip.copy_dtype = "float32"``, 1/2 for float16):

* choco: 2 d c M -- per edge, the public copy x̂_{i->j} and the mirror of x̂_{j->i}.
* diloco (d: the edges of the anchors' graph, ``gossip.anchor_topology``; the graph the
  pseudo-gradients are averaged on keeps no copies): M (the anchor, which is also the
  phase's start) + M (the pseudo-gradient's
  error-feedback residual; none with ``error_feedback = false``) + M (the outer momentum, only
  with ``outer_momentum > 0``) + 2 d c M (the anchors' CHOCO copies) + M (the parameters at
  the phase's end, only with ``background_rounds``). The neighbours' pseudo-gradients stay
  compressed until they are decoded into the anchor.
* exact-diloco: M (the anchor, alike at every peer) + M (the residual; none without error
  feedback) + M (the outer momentum, only with ``outer_momentum > 0``); no copies. The
  messages it holds stay compressed: at most (4 open + 2 kept closed phases) × n of them
  (peer/algorithms/dissemination.py), a dense anchor while one is taken or sent (2 M).
* ef-gradient: M (residual) + M (DGC velocity, only with ``ef_momentum > 0``) + M (the dense
  average written into the gradients) + 2 d c M (the consensus copies).

A round adds transients on top, freed when it ends: for a sparse codec one model-sized
difference x − x̂ while an update is encoded and, for top-k, its magnitudes (2 M; a dense
codec such as diloco's sign anchors encodes the difference a chunk at a time, with no
model-sized buffer); the codec's index coding
adds about 64 bytes per kept value (0.2 M at top-1 %, 3 M at top-20 %: diloco's default), and
so does decoding a neighbour's message. A dense resync adds its payload and the receiver's
buffer (2 M) while it is in flight. Compressed messages held between rounds (the last one
sent until acknowledged, neighbours' vectors until applied, receive buffers) add their
compressed size, a tenth of a model or so at top-20 %. The initial model, from which
edges opened in a swarm's first rounds start, lives in a temporary file, not in memory.
"""

from __future__ import annotations

from gossipgrad.peer.config import GossipSection

#: Bytes of a copy's element per dtype name (``gossip.copy_dtype``).
COPY_BYTES = {"float32": 4, "float16": 2}


def gossip_state_bytes(g: GossipSection, degree: int, model_bytes: int) -> int:
    """The gossip state a peer keeps between rounds (module docstring), in bytes.

    Args:
        g: the [gossip] section the peer runs with.
        degree: the edges the peer keeps.
        model_bytes: the model's float32 parameters, in bytes.
    """
    if degree < 0 or model_bytes < 0:
        raise ValueError(f"need degree >= 0 and model_bytes >= 0, got {degree}, {model_bytes}")
    copies = 2 * degree * model_bytes * COPY_BYTES[g.copy_dtype] // 4
    if g.algorithm == "choco":
        return copies
    residual = model_bytes if g.error_feedback else 0
    if g.algorithm == "exact-diloco":
        return model_bytes + residual + (model_bytes if g.outer_momentum > 0 else 0)
    if g.algorithm == "diloco":
        momentum = model_bytes if g.outer_momentum > 0 else 0
        phase_end = model_bytes if g.background_rounds else 0
        return model_bytes + residual + momentum + copies + phase_end
    velocity = model_bytes if g.ef_momentum > 0 else 0
    return residual + velocity + model_bytes + copies
