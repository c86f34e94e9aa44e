"""The config reference, generated from the field descriptions (docs/config.md is its
output, committed; a test keeps the two equal)."""

from __future__ import annotations

from typing import Any

from gossipgrad.peer.config.peer_config import PeerConfig
from gossipgrad.peer.config.recommended import DEFAULT_ALGORITHM, RECOMMENDED


def per_algorithm_keys() -> list[str]:
    """The ``[gossip]`` keys whose default depends on the algorithm, in table order."""
    return list(dict.fromkeys(k for row in RECOMMENDED.values() for k in row))


def iter_fields() -> list[tuple[str, Any, str, Any]]:
    """(dotted key, annotation, description, default) for every leaf key, in order; a key
    whose default depends on the algorithm gives the default algorithm's."""
    out = []
    for section_name, section_field in PeerConfig.model_fields.items():
        model = section_field.annotation
        earlier: dict[str, Any] = {}  # what a default factory that reads the section sees
        for name, f in model.model_fields.items():  # type: ignore[union-attr]
            default = f.get_default(call_default_factory=True, validated_data=earlier)
            earlier[name] = default
            out.append((f"{section_name}.{name}", f.annotation, f.description or "", default))
    return out


def _first_with(key: str) -> str:
    """The default algorithm if ``key`` applies to it, else the first one it applies to."""
    if key in RECOMMENDED[DEFAULT_ALGORITHM]:
        return DEFAULT_ALGORITHM
    return next(a for a, row in RECOMMENDED.items() if key in row)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def algorithm_defaults_table() -> list[str]:
    """Markdown: each algorithm's value of every per-algorithm key ('-': does not apply)."""
    algorithms = list(RECOMMENDED)
    lines = [
        "",
        "Defaults per algorithm (a key left unset takes its algorithm's value; a key set "
        "explicitly keeps it; `-`: the key does not apply):",
        "",
        "| key | " + " | ".join(f"`{a}`" for a in algorithms) + " |",
        "|---|" + "---|" * len(algorithms),
    ]
    for key in per_algorithm_keys():
        cells = [
            f"`{_shown(RECOMMENDED[a][key])}`" if key in RECOMMENDED[a] else "-" for a in algorithms
        ]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return lines


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
    per_algorithm = {f"gossip.{k}" for k in per_algorithm_keys()}
    current = None
    for key, _ann, desc, default in iter_fields():
        section = key.split(".")[0]
        if section != current:
            if current == "gossip":
                lines += algorithm_defaults_table()
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
        shown = f"`{_shown(default)}`"
        if key in per_algorithm:
            shown = f"per algorithm (`{_first_with(key.split('.', 1)[1])}`: {shown})"
        lines.append(f"| `{key.split('.', 1)[1]}` | {shown} | {desc} |")
    if current == "gossip":
        lines += algorithm_defaults_table()
    return "\n".join(lines) + "\n"
