"""Each gossip algorithm's recommended values for the ``[gossip]`` keys that depend on it.

A key the user leaves unset takes the chosen algorithm's value from this table; a key the
user sets keeps the user's value, even one equal to the table's. Before, every algorithm
started from choco's values, so ``algorithm = "diloco"`` alone ran one inner step per phase
with choco's top-1% codec: +57.8 % loss above DDP on a char-GPT task.

The values are the measured ones (docs/algorithms.md, BENCHMARKS.md):

- choco, ef-gradient: one gossip round per step with top-1% + int8 values (the values every
  algorithm had before this table).
- diloco: H = 5 on the exponential graph (Ying et al., NeurIPS 2021: i ± 2^k, every peer
  up to 5 peers, about 2 log2 n neighbours beyond), from BENCHMARKS.md "diloco's defaults on
  an unseen task": a user's char GPT (4 peers, 1,000 steps) ended +19.1 % above DDP with the
  earlier H = 10 on a ring, +15.2 % at H = 5 on the ring, +15.5 % at H = 10 on the full graph
  and +10.7 % (43x fewer bytes than DDP) with both, where all-reduce DiLoCo fp32 ends +9.5 %
  at H = 5: what one peer hears of the others each phase, and how often, is the lever. Over
  four seeds (BENCHMARKS.md, "diloco's defaults now") top-20 % with int2 values ended +10.7
  to +17.5 % above DDP, with int4 values +10.3 to +12.6 % (17 % more bytes; top-10 % + int2:
  +11.6 to +14.4 %), where the tuned spec ends +8.7 to +9.9 % on its own task: int4. The
  density and the 1-bit anchors from the row "H = 10, ``anchor_codec=sign``" of "The bytes
  against the quality" (4 peers: 1.7556 at 110x fewer bytes than DDP) and the 8-peer row
  "the same with 1-bit anchors: the spec now" (+9.0 % at 124x); the outer step from the
  rows ``outer_lr`` 0.8 / 1.3 / 2.0 (all worse than 1) and docs/algorithms.md ("η = 1,
  μ = 0 are the defaults": DiLoCo's lr 0.7 with Nesterov 0.9 lost 0.5-1.0 of loss at every
  H); ``anchor_gamma`` 0.5 from the same runs (γ 1 diverged with 2-bit anchors). The
  anchors gossip on a ring inside that graph (``anchor_topology``): each anchors' edge keeps
  two copies, an averaging edge none, so the state stays at a ring's 4 models at any swarm
  size (peer/algorithms/footprint.py).
- exact-diloco: BENCHMARKS.md, "Density against H at 8 peers" and "exact-diloco on the same
  unseen task": top-10 % + int2 at H = 5 ended +4.0 % above DDP at 63x fewer bytes on the
  8-peer char transformer (the earlier default, top-5 % at H = 10: +7.9 % at 168x; all-reduce
  DiLoCo int8 at H = 10: +5.9 % at 39x) and +11.8 % at 123x on the unseen 4-peer char GPT
  (top-5 % at H = 10: +21.5 % at 414x; all-reduce DiLoCo fp32 at H = 10: +11.4 % at 10x).
  Outer step as diloco's (η = 1, μ = 0: error feedback in place of outer momentum, as
  SparseLoCo has it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_ALGORITHM = "choco"

RECOMMENDED: dict[str, dict[str, Any]] = {
    "choco": {
        "local_steps": 1,
        "codec": "topk:0.01+int8",
        "topology": "ring",
        "copy_dtype": "float32",
    },
    "ef-gradient": {
        "local_steps": 1,
        "codec": "topk:0.01+int8",
        "topology": "ring",
        "copy_dtype": "float32",
    },
    "diloco": {
        "local_steps": 5,
        "topology": "exponential",
        "anchor_topology": "ring",
        "codec": "topk:0.2+int4",
        "anchor_codec": "sign",
        "anchor_gamma": 0.5,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "copy_dtype": "float16",
    },
    "exact-diloco": {
        "local_steps": 5,
        "codec": "topk:0.1+int2",
        "topology": "ring",
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
    },
}
"""algorithm -> {key: recommended value}; a key missing from a row does not apply to that
algorithm (it takes the value of the first row that has it, and nothing reads it)."""


def recommended(algorithm: str, key: str) -> Any:
    """The value ``key`` takes under ``algorithm`` when the user leaves it unset."""
    row = RECOMMENDED.get(algorithm, RECOMMENDED[DEFAULT_ALGORITHM])
    if key in row:
        return row[key]
    return next(r[key] for r in RECOMMENDED.values() if key in r)


def default_for(key: str) -> Callable[[dict[str, Any]], Any]:
    """A pydantic ``default_factory`` for ``key``: the recommended value of the algorithm
    validated before it (``algorithm`` is the section's first field)."""

    def factory(data: dict[str, Any]) -> Any:
        return recommended(data.get("algorithm", DEFAULT_ALGORITHM), key)

    factory.__doc__ = f"The chosen algorithm's recommended {key}."
    return factory
