"""Spec strings: the grammar, and building a codec from one against the registry.

Grammar (whitespace around tokens is ignored)::

    spec   := stage ("+" stage)*
    stage  := NAME (":" arg)*
    arg    := NUMBER            positional parameter, e.g. topk:0.01, qsgd:16
            | FLAG              a word switching an option on, e.g. int8:sr, topk:0.01:exact
            | KEY "=" NUMBER    a named option, e.g. int8:block=128

A spec has at most one sparsifier (topk, chunktopk, randomk) followed by at most one quantizer
(none, fp16, bf16, int8, int4, int2, qsgd, sign). This module imports the codec modules, which
fill :data:`~.registry.REGISTRY` as they load, so importing it is enough to parse any spec.
"""

from __future__ import annotations

import re

from gossipgrad.compression import quantizers, sparsifiers
from gossipgrad.compression.base import Codec
from gossipgrad.compression.registry import REGISTRY, register, valid_forms
from gossipgrad.compression.stage_args import StageArgs

__all__ = ["REGISTRY", "StageArgs", "from_spec", "register", "valid_forms"]

#: The modules whose classes register themselves (imported for that; named so it is explicit).
CODEC_MODULES = (quantizers, sparsifiers)

_WORD = re.compile(r"[a-z][a-z0-9_]*\Z")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_stage(text: str) -> tuple[str, StageArgs]:
    parts = [p.strip() for p in text.split(":")]
    name = parts[0]
    if not name:
        raise ValueError("empty stage")
    args = StageArgs(stage=text.strip())
    for p in parts[1:]:
        if not p:
            raise ValueError(f"empty argument in {text.strip()!r}")
        if "=" in p:
            k, _, v = p.partition("=")
            k, v = k.strip(), v.strip()
            if not _WORD.match(k) or not v or k in args.options:
                raise ValueError(f"bad option {p!r} in {text.strip()!r}")
            args.options[k] = v
        elif _WORD.match(p) and not _is_number(p):
            args.flags.append(p)
        else:
            args.positional.append(p)
    return name, args


def from_spec(spec: str) -> Codec:
    """Build a codec from its spec string, e.g. ``"topk:0.01+int8"``.

    Raises:
        ValueError: naming the problem and listing the valid forms.
    """
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a str, got {type(spec).__name__}")
    try:
        stages = spec.split("+")
        if not spec.strip() or any(not s.strip() for s in stages):
            raise ValueError("empty stage")
        codec: Codec | None = None
        for text in stages:
            name, args = _parse_stage(text)
            cls = REGISTRY.get(name)
            if cls is None:
                raise ValueError(f"unknown codec {name!r}")
            stage = cls.from_args(args)
            codec = stage if codec is None else codec >> stage
        assert codec is not None
        return codec
    except ValueError as e:
        raise ValueError(f"bad codec spec {spec!r}: {e}. Valid forms: {valid_forms()}") from None
