"""Spec-string grammar and the codec registry: the single list of codecs that exist.

Grammar (whitespace around tokens is ignored)::

    spec   := stage ("+" stage)*
    stage  := NAME (":" arg)*
    arg    := NUMBER            positional parameter, e.g. topk:0.01, qsgd:16
            | FLAG              a word switching an option on, e.g. int8:sr, topk:0.01:exact
            | KEY "=" NUMBER    a named option, e.g. int8:block=128

A spec has at most one sparsifier (topk, randomk) followed by at most one quantizer (none, fp16,
bf16, int8, int4, qsgd, sign). Codec classes register themselves with :func:`register`; the
registry is what :func:`from_spec` parses against and what error messages list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gossipgrad.compression.base import Codec

__all__ = ["REGISTRY", "StageArgs", "from_spec", "register", "valid_forms"]

#: name -> codec class. Filled by the @register decorator when the codec modules import.
REGISTRY: dict[str, type[Codec]] = {}

_NAME = re.compile(r"[a-z][a-z0-9]*\Z")
_WORD = re.compile(r"[a-z][a-z0-9_]*\Z")

C = TypeVar("C", bound="type[Codec]")


def register(cls: C) -> C:
    """Class decorator adding a codec class to :data:`REGISTRY` under ``cls.name``."""
    name = cls.name
    if not _NAME.match(name):
        raise ValueError(f"codec name {name!r} must match {_NAME.pattern}")
    if name in REGISTRY:
        raise ValueError(f"codec name {name!r} registered twice")
    REGISTRY[name] = cls
    return cls


def valid_forms() -> str:
    """Human-readable list of every registered stage form plus composition examples."""
    forms = ", ".join(REGISTRY[n].grammar for n in sorted(REGISTRY))
    return f"{forms}; compose as SPARSIFIER+QUANTIZER, e.g. 'topk:0.01+int8'"


@dataclass
class StageArgs:
    """The arguments of one stage: ``topk:0.01:exact`` -> positional ['0.01'], flags {'exact'}."""

    stage: str
    positional: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)

    def expect(
        self, *, positional: int = 0, flags: tuple[str, ...] = (), options: tuple[str, ...] = ()
    ) -> None:
        """Raise ValueError if anything beyond the given shape was passed."""
        if len(self.positional) != positional:
            raise ValueError(
                f"{self.stage!r} takes {positional} positional argument(s), "
                f"got {len(self.positional)}"
            )
        for f in self.flags:
            if f not in flags:
                allowed = ", ".join(flags) or "none"
                raise ValueError(f"unknown flag {f!r} in {self.stage!r} (allowed: {allowed})")
        if len(set(self.flags)) != len(self.flags):
            raise ValueError(f"repeated flag in {self.stage!r}")
        for k in self.options:
            if k not in options:
                allowed = ", ".join(options) or "none"
                raise ValueError(f"unknown option {k!r} in {self.stage!r} (allowed: {allowed})")

    def int_option(self, key: str, default: int) -> int:
        """Parse the integer option ``key=N`` (ValueError naming it when not an integer)."""
        raw = self.options.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"option {key}={raw!r} in {self.stage!r} is not an integer") from None


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
        stages = [s for s in spec.split("+")]
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
