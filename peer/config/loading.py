"""Loading a config: a TOML file plus dotted-key overrides (``--section.key=value``),
validated into a ``PeerConfig`` with one-line errors that name the key."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gossipgrad.peer.config.base import ConfigError
from gossipgrad.peer.config.peer_config import PeerConfig
from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _one_line(err: ValidationError) -> str:
    """Turn pydantic's report into 'key: problem' lines (one per error)."""
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    node = tree
    for s in sections:
        node = node.setdefault(s, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{s}' is not a section")
    node[leaf] = value


def build_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Validate a raw TOML tree plus dotted-key overrides into a PeerConfig.

    Raises:
        ConfigError: naming each bad key and why.
    """
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for key, value in (overrides or {}).items():
        _set_path(tree, key, value)
    try:
        return PeerConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Read a TOML file (or none) and apply overrides; see build_config."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return build_config(raw, overrides)
