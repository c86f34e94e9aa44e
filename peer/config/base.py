"""What every config section shares: the error type, strict models, the address type."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ADDRESS_PATTERN = r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):\d{1,5}$"
Address = Annotated[str, Field(pattern=ADDRESS_PATTERN)]
