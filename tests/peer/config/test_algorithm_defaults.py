"""Issue 42: a [gossip] key the user leaves unset takes the chosen algorithm's recommended
value; a key set explicitly keeps it, even at the same value; the reference shows each
algorithm's defaults and no description contradicts the default it describes."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
from gossipgrad.compression import from_spec
from gossipgrad.peer.config import ConfigError, GossipSection, build_config, load_config
from gossipgrad.peer.config.recommended import RECOMMENDED
from gossipgrad.peer.config.reference import iter_fields, markdown_reference, per_algorithm_keys

pytestmark = pytest.mark.timeout(60)

DILOCO = {
    "local_steps": 5,
    "topology": "exponential",
    "anchor_topology": "ring",
    "codec": "topk:0.2+int4",
    "anchor_codec": "sign",
    "anchor_gamma": 0.5,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "copy_dtype": "float16",
}


def gossip(**keys: Any) -> GossipSection:
    return build_config({}, {f"gossip.{k}": v for k, v in keys.items()}).gossip


def test_diloco_alone_takes_its_recommended_values() -> None:
    g = gossip(algorithm="diloco")
    assert {k: getattr(g, k) for k in DILOCO} == DILOCO
    assert g.chosen_defaults() == DILOCO


def test_choco_keeps_its_values_and_chooses_only_its_own_keys() -> None:
    g = gossip()
    assert (g.local_steps, g.codec, g.topology, g.copy_dtype) == (
        1,
        "topk:0.01+int8",
        "ring",
        "float32",
    )
    assert g.chosen_defaults() == {
        "local_steps": 1,
        "codec": "topk:0.01+int8",
        "topology": "ring",
        "copy_dtype": "float32",
    }


def test_a_key_set_to_the_recommended_value_counts_as_set(tmp_path: Path) -> None:
    """TOML sets the algorithm and H = 5 (diloco's own value), the command line the codec
    to choco's: both stay as set, and neither is reported as chosen."""
    f = tmp_path / "site.toml"
    f.write_text('[gossip]\nalgorithm = "diloco"\nlocal_steps = 5\n')
    g = load_config(f, {"gossip.codec": "topk:0.01+int8"}).gossip
    assert (g.local_steps, g.codec, g.anchor_codec) == (5, "topk:0.01+int8", "sign")
    chosen = g.chosen_defaults()
    assert "local_steps" not in chosen and "codec" not in chosen
    assert chosen["anchor_codec"] == "sign"


def test_a_command_line_value_beats_the_algorithm_default() -> None:
    g = build_config({"gossip": {"algorithm": "diloco"}}, {"gossip.local_steps": "1"}).gossip
    assert g.local_steps == 1
    assert g.codec == "topk:0.2+int4"


@pytest.mark.parametrize("algorithm", list(RECOMMENDED))
def test_every_recommended_value_is_a_valid_setting(algorithm: str) -> None:
    """Defaults skip validation, so each one is checked here as if a user had set it; codec
    specs must be in their canonical spelling (what validation would turn them into)."""
    row = RECOMMENDED[algorithm]
    g = gossip(algorithm=algorithm, **row)
    assert {k: getattr(g, k) for k in row} == row
    for key in ("codec", "anchor_codec"):
        if key in row:
            assert from_spec(row[key]).spec == row[key]


def test_the_table_names_exactly_the_algorithms_the_config_takes() -> None:
    assert set(RECOMMENDED) == set(
        typing.get_args(GossipSection.model_fields["algorithm"].annotation)
    )
    with pytest.raises(ConfigError):
        gossip(algorithm="dilco")


def _reference_table() -> dict[str, dict[str, str]]:
    """The reference's "Defaults per algorithm" table: key -> algorithm -> cell."""
    md = markdown_reference()
    start = md.index("Defaults per algorithm")
    lines = md[start:].splitlines()[2:]
    rows = lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    header = [c.strip().strip("`") for c in rows[0].strip("|").split("|")][1:]
    out = {}
    for line in rows[2:]:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(header, cells[1:], strict=True))
    return out


def test_the_reference_shows_what_each_algorithm_gets() -> None:
    """Each cell is the value a config with only that algorithm set really has."""
    table = _reference_table()
    assert set(table) == set(per_algorithm_keys())
    assert set(table["codec"]) == set(RECOMMENDED)
    for algorithm in RECOMMENDED:
        g = gossip(algorithm=algorithm)
        for key, cells in table.items():
            if cells[algorithm] != "-":
                value = getattr(g, key)
                assert cells[algorithm] == (repr(value) if isinstance(value, str) else str(value))
    assert table["local_steps"]["diloco"] == "5"
    assert table["topology"]["diloco"] == "'exponential'"


# A description claims a default in one of these forms; the value must be the key's default
# (for a per-algorithm key, the default of some algorithm).
_MARKED = re.compile(r"(?:^|\.\s+)([\w.:+\-]+):[^.]*?\(default\)")  # "choco: ... (default)"
_STATED = re.compile(r"\(default:?\s+`?([\w.:+\-]+)`?\)")  # "(default 3)", "(default: 3)"
# What the algorithm key's description says each algorithm does, as claims on the defaults a
# user gets with only the algorithm set: phrase -> (algorithm, predicate).
_BEHAVIOUR = {
    r"Nesterov momentum": ("diloco", lambda g: g.outer_momentum > 0 and g.outer_nesterov),
    r"heavy.ball": ("diloco", lambda g: g.outer_momentum > 0 and not g.outer_nesterov),
    r"(?:periodic|plain) averaging": ("diloco", lambda g: (g.outer_lr, g.outer_momentum) == (1, 0)),
    r"every step": ("diloco", lambda g: g.local_steps == 1),
}


def _defaults_of(key: str) -> set[str]:
    section, name = key.split(".", 1)
    if section != "gossip" or name not in per_algorithm_keys():
        return {str(d) for k, _a, _d, d in iter_fields() if k == key}
    return {str(getattr(gossip(algorithm=a), name)) for a in RECOMMENDED}


def _contradictions() -> list[str]:
    bad = []
    for key, _ann, desc, _default in iter_fields():
        defaults = _defaults_of(key)
        for pattern in (_MARKED, _STATED):
            for claimed in pattern.findall(desc):
                if claimed.rstrip(".") not in defaults:
                    bad.append(f"{key}: claims default {claimed!r}, is {sorted(defaults)}")
    algorithm_desc = GossipSection.model_fields["algorithm"].description or ""
    for sentence in re.split(r"(?<=\.)\s+(?=[a-z\-]+:)", algorithm_desc):
        name = sentence.split(":", 1)[0]
        for phrase, (algorithm, holds) in _BEHAVIOUR.items():
            if (
                name == algorithm
                and re.search(phrase, sentence)
                and not holds(gossip(algorithm=name))
            ):
                bad.append(f"gossip.algorithm: {name} described as {phrase!r}, not its default")
    return bad


def test_no_description_contradicts_its_default() -> None:
    assert _contradictions() == []


def test_the_check_finds_a_drifted_description(monkeypatch) -> None:
    """The check itself can fail: the description issue 42 found (diloco's outer step "with
    Nesterov momentum" while the default has none), and a wrong "(default)" mark."""
    field = GossipSection.model_fields["algorithm"]
    monkeypatch.setattr(
        field,
        "description",
        "choco: gossip. ef-gradient: gradients (default). diloco: phases, an outer SGD step "
        "with Nesterov momentum on an anchor.",
    )
    found = _contradictions()
    assert any("'ef-gradient'" in b for b in found), found
    assert any("Nesterov" in b for b in found), found


def test_the_swarm_launcher_leaves_codec_and_topology_to_the_algorithm() -> None:
    """``gossipgrad-swarm --set gossip.algorithm=diloco`` runs diloco's codec and graph (its
    --codec and --topology once pinned choco's), and either flag given still wins."""
    from gossipgrad.experiment.swarm import build_parser, overrides_from

    def chosen(*argv: str) -> GossipSection:
        return load_config(None, overrides_from(build_parser().parse_args(argv))).gossip

    g = chosen("--set", "gossip.algorithm=diloco")
    assert (g.codec, g.topology, g.local_steps) == ("topk:0.2+int4", "exponential", 5)
    g = chosen("--set", "gossip.algorithm=diloco", "--codec", "int8", "--topology", "ring")
    assert (g.codec, g.topology) == ("int8", "ring")
    assert (chosen().codec, chosen().topology) == ("topk:0.01+int8", "ring")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        overrides_from(build_parser().parse_args(["--set", "gossip.algorithm"]))
