"""The config reference, generated from the field descriptions (docs/config.md is its
output, committed; a test keeps the two equal)."""

from __future__ import annotations

from typing import Any

from gossipgrad.peer.config.peer_config import PeerConfig


def iter_fields() -> list[tuple[str, Any, str, Any]]:
    """(dotted key, annotation, description, default) for every leaf key, in order."""
    out = []
    for section_name, section_field in PeerConfig.model_fields.items():
        model = section_field.annotation
        for name, f in model.model_fields.items():  # type: ignore[union-attr]
            default = f.get_default(call_default_factory=True)
            out.append((f"{section_name}.{name}", f.annotation, f.description or "", default))
    return out


def markdown_reference() -> str:
    """The config reference as markdown (docs/config.md is this, committed)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `peer/config/` by `gossipgrad-peer --config-reference`.",
        "Every key can be set in the TOML file under its section, or on the command line as",
        "`--set section.key=value` (the syntax every gossipgrad tool takes) or",
        '`--section.key=value`; a list value is `A,B` or a TOML array `["A", "B"]`.',
        "",
    ]
    current = None
    for key, _ann, desc, default in iter_fields():
        section = key.split(".")[0]
        if section != current:
            current = section
            doc = (PeerConfig.model_fields[section].annotation.__doc__ or "").strip()
            lines += [
                "",
                f"## [{section}]",
                "",
                doc,
                "",
                "| key | default | meaning |",
                "|---|---|---|",
            ]
        shown = str(default) if not isinstance(default, str) else repr(default)
        lines.append(f"| `{key.split('.', 1)[1]}` | `{shown}` | {desc} |")
    return "\n".join(lines) + "\n"
