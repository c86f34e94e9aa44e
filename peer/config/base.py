"""What every config section shares: the error type, strict models, the address type."""

from __future__ import annotations

import sys
from typing import Annotated, Any, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key."""


def list_from_text(text: str) -> list[Any]:
    """A list value as a command line spells it: ``A,B`` (``""``: empty) or a TOML array
    ``["A", "B"]`` -- the one list syntax of every gossipgrad tool's ``--set KEY=VALUE``."""
    if text.lstrip().startswith("["):
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{text!r} is not a TOML array ({err})") from None
        if isinstance(value, list):
            return value
    return [v.strip() for v in text.split(",") if v.strip()]


def split_list_strings(model: type[BaseModel], data: Any) -> Any:
    """``data`` with a string given for a list field read by :func:`list_from_text`, so a
    model takes the command lines' list syntax whichever tool parsed them."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        value = out.get(name)
        if isinstance(value, str) and get_origin(field.annotation) is list:
            out[name] = list_from_text(value)
    return out


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated, and a
    list key also takes ``A,B,...`` (:func:`split_list_strings`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _lists_from_strings(cls, data: Any) -> Any:
        return split_list_strings(cls, data)


ADDRESS_PATTERN = r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):\d{1,5}$"
Address = Annotated[str, Field(pattern=ADDRESS_PATTERN)]
