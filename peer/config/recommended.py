"""Each gossip algorithm's recommended values for the ``[gossip]`` keys that depend on it.

A key the user leaves unset takes the chosen algorithm's value from this table; a key the
user sets keeps the user's value, even one equal to the table's. Before, every algorithm
started from choco's values, so ``algorithm = "diloco"`` alone ran one inner step per phase
with choco's top-1% codec: +57.8 % loss above DDP on a char-GPT task.

The values are the measured ones (docs/algorithms.md, BENCHMARKS.md):

- choco, ef-gradient: one gossip round per step with top-1% + int8 values (the values every
  algorithm had before this table).
- diloco: BENCHMARKS.md, "The bytes against the quality", row "H = 10, ``anchor_codec=sign``"
  (4 peers: 1.7556 at 110x fewer bytes than DDP) and the 8-peer row "the same with 1-bit
  anchors: the spec now" (+9.0 % on DDP at 124x); the outer step from the rows ``outer_lr``
  0.8 / 1.3 / 2.0 (all worse than 1) and docs/algorithms.md ("η = 1, μ = 0 are the
  defaults": DiLoCo's lr 0.7 with Nesterov 0.9 lost 0.5-1.0 of loss at every H);
  ``anchor_gamma`` 0.5 from the same runs (γ 1 diverged with 2-bit anchors).
- exact-diloco: issue 43's in-process calibration of exact aggregation (8 workers, 1,000
  steps of the char transformer): top-5 % + int2 with error feedback at H = 10 ended at 1.7480
  at 219x fewer bytes than DDP, diloco's spec's loss (1.7482) at 58 % of its bytes; top-1.5 %
  at H = 30 was too sparse at that size (2.0368). Outer step as diloco's (η = 1, μ = 0: error
  feedback in place of outer momentum, as SparseLoCo has it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_ALGORITHM = "choco"

RECOMMENDED: dict[str, dict[str, Any]] = {
    "choco": {"local_steps": 1, "codec": "topk:0.01+int8", "copy_dtype": "float32"},
    "ef-gradient": {"local_steps": 1, "codec": "topk:0.01+int8", "copy_dtype": "float32"},
    "diloco": {
        "local_steps": 10,
        "codec": "topk:0.2+int2",
        "anchor_codec": "sign",
        "anchor_gamma": 0.5,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "copy_dtype": "float16",
    },
    "exact-diloco": {
        "local_steps": 10,
        "codec": "topk:0.05+int2",
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
