"""The codec registry: the single table of the codec stages that exist, by spec name.

Codec modules (:mod:`.quantizers`, :mod:`.sparsifiers`) fill it with :func:`register` as they
are imported; :mod:`.spec` imports them and parses against it. This module depends only on the
base classes, so nothing here imports back into a codec module.
"""

from __future__ import annotations

import re
from typing import TypeVar

from gossipgrad.compression.base import Codec

__all__ = ["REGISTRY", "register", "valid_forms"]

#: name -> codec class. Filled by the @register decorator when the codec modules import.
REGISTRY: dict[str, type[Codec]] = {}

_NAME = re.compile(r"[a-z][a-z0-9]*\Z")

C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator adding a codec class to :data:`REGISTRY` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ValueError(f"only Codec subclasses can be registered, got {cls!r}")
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
